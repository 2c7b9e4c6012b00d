"""The optimized module keeps the model's repeated blocks as submodules its graph calls.

``fxopt.rewrite.blocks.keep_blocks`` runs after the passes: each block becomes a GraphModule at
the block's own path, owning the block's parameters (the user's objects), and the root graph
calls it. Checked here: the golden root graph before and after, idempotence, the root reading no
block's state, hooks registered on a block after optimize firing, state_dict unchanged, both
capture paths and both training modes, regions inside blocks only, and the reason a block
stays flat when it cannot be one call. Each model is optimized once for the file; the Hugging
Face Llama's regions are also checked for the module names they carry
(tests/test_region_names.py's property).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import fxopt
from fxopt.analysis.blocks import repeated_block
from fxopt.capture.trace import trace
from fxopt.rewrite.blocks import META_KEY, keep_blocks
from fxopt.runtime.input_guard import guard_inputs
from fxopt.runtime.regions import CheckpointedRegion
from fxopt.models_zoo.transformer import TinyLanguageModel

transformers = pytest.importorskip("transformers")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale):
        return x + self.fc(self.norm(x)) * scale


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        scale = x.mean()
        for block in self.blocks:
            x = block(x, scale)
        return self.head(x)


GOLDEN_BEFORE = """\
def forward(self, x):
    mean = x.mean()
    blocks_0_norm = getattr(self.blocks, "0").norm(x)
    blocks_0_fc = getattr(self.blocks, "0").fc(blocks_0_norm);  blocks_0_norm = None
    mul = blocks_0_fc * mean;  blocks_0_fc = None
    add = x + mul;  x = mul = None
    blocks_1_norm = getattr(self.blocks, "1").norm(add)
    blocks_1_fc = getattr(self.blocks, "1").fc(blocks_1_norm);  blocks_1_norm = None
    mul_1 = blocks_1_fc * mean;  blocks_1_fc = mean = None
    add_1 = add + mul_1;  add = mul_1 = None
    head = self.head(add_1);  add_1 = None
    return head"""

GOLDEN_AFTER = """\
def forward(self, x):
    mean = x.mean()
    blocks_0 = getattr(self.blocks, "0")(x, mean);  x = None
    blocks_1 = getattr(self.blocks, "1")(blocks_0, mean);  blocks_0 = mean = None
    head = self.head(blocks_1);  blocks_1 = None
    return head"""

GOLDEN_BLOCK = """\
def forward(self, x, mean):
    blocks_0_norm = self.norm(x)
    blocks_0_fc = self.fc(blocks_0_norm);  blocks_0_norm = None
    mul = blocks_0_fc * mean;  blocks_0_fc = mean = None
    add = x + mul;  x = mul = None
    return add"""


def _code(gm: fx.GraphModule) -> str:
    return gm.code.strip()


def test_golden_root_and_block_graphs_and_idempotence():
    model = TwoBlocks()
    x = torch.randn(3, 8)
    gm = trace(model, (x,))
    assert _code(gm) == GOLDEN_BEFORE
    result = keep_blocks(gm)
    assert result.modified and gm.meta[META_KEY].kept == ["blocks.0", "blocks.1"]
    assert _code(gm) == GOLDEN_AFTER
    assert _code(gm.blocks[0]) == GOLDEN_BLOCK
    assert not keep_blocks(gm).modified and _code(gm) == GOLDEN_AFTER
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    assert list(gm.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(gm.parameters(), model.parameters(), strict=True))


def _root_reads(gm: fx.GraphModule) -> list[str]:
    """What the root graph reads or calls, but for the input guard's dtype and device check of
    the state (an export-captured module's), which computes nothing with it."""
    return [n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")
            and not (n.users and all(u.target is guard_inputs for u in n.users))]


def _gpt():
    torch.manual_seed(0)
    model = TinyLanguageModel(vocab_size=128, dim=32, heads=4, depth=2, max_seq_len=32)
    for module in model.modules():  # train-mode outputs compared without dropout's randomness
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, ((torch.randint(0, 128, (2, 16)),), None), ["blocks.0", "blocks.1"]


def _llama():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False))
    ids = torch.randint(0, 128, (2, 16))
    return model, ((), {"input_ids": ids, "labels": ids}), ["model.layers.0", "model.layers.1"]


_OPTIMIZED: dict = {}


def _optimized(build):
    """(model, (args, kwargs), blocks, ``optimize(model, ..., memory_budget="min")``): one per
    model, shared by the tests of this file (they change nothing in it but training flags and a
    hook they remove)."""
    if build not in _OPTIMIZED:
        model, (args, kwargs), blocks = build()
        slim = fxopt.optimize(model, args, example_kwargs=kwargs, memory_budget="min")
        _OPTIMIZED[build] = model, (args, kwargs), blocks, slim
    return _OPTIMIZED[build]


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt-fx", "llama-export"])
def test_blocks_are_called_and_own_their_parameters(build):
    model, (args, kwargs), blocks, slim = _optimized(build)
    assert slim.meta[META_KEY].kept == blocks and not slim.meta[META_KEY].flat
    reads = _root_reads(slim)
    for path in blocks:
        assert path in reads  # the root calls the block ...
        assert not any(r.startswith(path + ".") for r in reads)  # ... and reads nothing in it
        assert isinstance(slim.get_submodule(path), fx.GraphModule)
    # a checkpointed region lies in one block (and lives there), or outside every block
    for region in (v for v in vars(slim).values() if isinstance(v, CheckpointedRegion)):
        assert {repeated_block(slim, n) for n in region.body.graph.nodes
                if n.op.startswith("call_")} == {None}
    assert any(isinstance(v, CheckpointedRegion)
               for path in blocks for v in vars(slim.get_submodule(path)).values())
    assert list(slim.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(slim.parameters(), model.parameters(), strict=True))

    calls = []
    handle = slim.get_submodule(blocks[1]).register_forward_hook(lambda *_: calls.append(1))
    for training in (True, False):  # the eval-mode graph calls the blocks too
        slim.train(training)
        model.train(training)
        with torch.no_grad():
            got, expected = slim(*args, **(kwargs or {})), model(*args, **(kwargs or {}))
        if kwargs:
            got, expected = got.logits, expected.logits
        torch.testing.assert_close(got, expected)
    handle.remove()
    assert calls == [1, 1]


def test_regions_of_a_hugging_face_model_name_their_modules():
    """Regions carry the module path they run in (``model.layers.1``, with the submodules they
    start and end in), in the report and in the pass's stats: tests/test_region_names.py's
    property on the Llama optimized here (one optimize serves both)."""
    llama = _optimized(_llama)[3]
    stats = next(p for p in llama.fxopt_report.passes if p.name == "checkpoint").stats
    regions = stats["regions"]
    assert regions
    layers = [r for r in regions if r.module.startswith("model.layers.")]
    assert layers, [r.module for r in regions]
    for region in layers:
        number = region.module.split(".")[2]
        assert number.isdigit()  # the layer index, as the user numbers layers
        for inner in (region.from_module, region.to_module):
            assert inner.startswith(region.module)
    report = str(llama.fxopt_report)
    assert f"nodes in {layers[0].module}" in report
    assert region.as_dict()["module"] == region.module  # in the JSON report too


class Shared(nn.Module):
    """One block applied twice with a computation between the calls that feeds the second:
    the block's nodes cannot be one call."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        y = self.blocks[0](x, 1.0)
        y = self.blocks[0](y.relu(), 1.0)
        return self.blocks[1](y, 1.0)


def test_a_block_that_cannot_be_one_call_stays_flat_with_its_reason():
    model = Shared()
    x = torch.randn(2, 8)
    gm = trace(model, (x,))
    keep_blocks(gm)
    info = gm.meta[META_KEY]
    assert info.kept == ["blocks.1"]
    assert [path for path, _ in info.flat] == ["blocks.0"]
    assert "feeds back" in info.flat[0][1]
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)



class SequentialBody(nn.Module):
    """Repeated blocks that are themselves Sequentials (conv, norm, activation), as many CNNs
    write them."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1),
                                                  nn.BatchNorm2d(8), nn.ReLU())
                                    for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_block_or_a_model_that_is_a_sequential_indexes_like_one(capture):
    """``model.body[1][0].requires_grad_(False)``, ``len(model)``, ``for layer in model``: a
    kept block standing for a Sequential, and the optimized module of a Sequential model, are
    GraphModules, and indexing one raised ``TypeError: 'Sequential' object is not
    subscriptable``. Both now answer position, slice, length, iteration and membership with
    their own submodules, in order, which hold the user's parameters, on deep copies too;
    freezing a layer reached so trains as on the model."""
    torch.manual_seed(0)
    model, x = SequentialBody(), torch.randn(2, 3, 8, 8)
    slim = fxopt.optimize(model, x, capture=capture, memory_budget="min", verify=False,
                          predict_memory=False)
    assert fxopt.blocks(slim) == ["body.0", "body.1", "body.2"]
    for optimized in (slim, copy.deepcopy(slim)):
        block = optimized.body[1]
        assert isinstance(block, fx.GraphModule) and len(block) == 3
        assert [type(m) for m in block] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
        assert block[-1] is list(block)[2] and block[0] in block and model.head not in block
        assert isinstance(block[1:], nn.Sequential) and list(block[1:]) == list(block)[1:]
    assert slim.body[1][0].weight is model.body[1][0].weight
    assigned = copy.deepcopy(slim)  # the operations a script applies keep the interface
    state = {k: v.clone() for k, v in assigned.state_dict().items()}
    assigned.load_state_dict(state, assign=True)
    assert assigned.body[1][0].weight.data_ptr() == state["body.1.0.weight"].data_ptr()
    assert len(assigned.to(torch.float64).body[1]) == 3
    assert assigned.body[1][0].weight.dtype == torch.float64
    for module in (model, slim):
        module.body[1][0].requires_grad_(False)
        module(x).square().sum().backward()
    assert slim.body[1][0].weight.grad is None
    for (name, p), q in zip(model.named_parameters(), slim.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimized = fxopt.optimize(mlp, torch.randn(4, 8), capture=capture, verify=False,
                               predict_memory=False)
    assert len(optimized) == 3 and [type(m) for m in optimized] == [nn.Linear, nn.ReLU, nn.Linear]
    assert optimized[0].weight is mlp[0].weight and optimized[-1].weight is mlp[2].weight
