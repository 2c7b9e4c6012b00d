"""fxopt.export writes each block the optimized module calls as code of its own.

The optimized module keeps every repeated block a GraphModule the root graph calls
(``fxopt.rewrite.blocks``); the exported folder keeps that structure: each block is an instance
of a generated class whose ``forward`` is the block graph's code (blocks with the same code
share one class), holding its own parameters, buffers and submodules at the same paths, and
the root's ``forward`` calls it. Checked here: the generated code (golden), the classes,
state_dict keys, order and shapes, outputs and gradients against the optimized module, regions
inside blocks under ``memory_budget="min"``, a block with a graph per training mode (eval
output equal to the user's model), FSDP2 sharding per block, nested graph modules and a block
with hooks.
"""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

import fxopt
from fxopt.export.codegen import EVAL_METHOD
from fxopt.export.writer import ExportError, export, load_exported


class Residual(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x, scale):
        return x + self.fc(self.norm(x)) * scale


class Residuals(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Residual(), Residual()])

    def forward(self, x):
        scale = x.mean()
        for layer in self.layers:
            x = layer(x, scale)
        return x


GOLDEN_BLOCK = '''\
class Residual(torch.nn.Module):
    """The code of blocks layers.0, layers.1; the model's __init__ gives each its parameters, \
buffers and submodules."""

    def forward(self, input_0, mean):
        norm = self.norm(input_0)
        fc = self.fc(norm);  norm = None
        mul = fc * mean;  fc = mean = None
        add = input_0 + mul;  input_0 = mul = None
        return add
'''

GOLDEN_ROOT_FORWARD = '''\
    def forward(self, x):
        mean = x.mean()
        layers_0 = getattr(self.layers, "0")(x, mean);  x = None
        layers_1 = getattr(self.layers, "1")(layers_0, mean);  layers_0 = mean = None
        return layers_1
'''


class Block(nn.Module):
    """A block whose forward depends on ``self.training`` (functional dropout), with BatchNorm:
    the optimized block has a graph per training mode, and buffers."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.bn = nn.BatchNorm1d(4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x, scale):
        y = self.fc2(torch.relu(self.bn(self.fc1(self.norm(x)))))
        return x + F.dropout(y, 0.1, self.training) * scale


class Stack(nn.Module):
    def __init__(self, depth: int = 3, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.embed(x)
        scale = h.mean()
        for layer in self.layers:
            h = layer(h, scale)
        return self.head(h)


BLOCKS = ["layers.0", "layers.1", "layers.2"]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """name -> (user's model, input, optimized module, export result, exported module) for the
    default pipeline and for memory_budget="min"."""
    root = tmp_path_factory.mktemp("export_blocks")
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(64, 8)
    cases = {}
    for name, options in {"default": {}, "min": {"memory_budget": "min"}}.items():
        slim = fxopt.optimize(model, (x,), **options)
        assert fxopt.blocks(slim) == BLOCKS
        result = export(slim, root / name, example_inputs=(x,))
        cases[name] = (model, x, slim, result, load_exported(root / name).load())
    return cases


def _class_source(source: str, name: str) -> str:
    match = re.search(rf"^class {name}\(.*?(?=^\S)", source, re.S | re.M)
    assert match, source
    return match.group(0).rstrip("\n") + "\n"


def test_golden_block_class_and_root_call(tmp_path):
    x = torch.randn(3, 4)
    slim = fxopt.optimize(Residuals(), (x,), passes=[])
    result = export(slim, tmp_path / "out", example_inputs=(x,))
    assert result.verification.ok
    source = (tmp_path / "out" / "model.py").read_text()
    assert _class_source(source, "Residual") == GOLDEN_BLOCK
    assert GOLDEN_ROOT_FORWARD in source
    assert source.count(" = Residual()") == 2  # one class, an instance per block


@pytest.mark.parametrize("name", ["default", "min"])
def test_blocks_are_generated_classes_the_root_calls(stacks, name):
    _, _, slim, result, exported = stacks[name]
    assert result.verification.ok
    assert isinstance(exported.layers, nn.ModuleList)
    classes = [type(layer) for layer in exported.layers]
    assert all(c.__module__ == type(exported).__module__ and c.__name__.startswith("Block")
               for c in classes)
    assert all(hasattr(c, EVAL_METHOD) for c in classes)  # the block's eval-mode graph
    if name == "default":  # identical blocks share one class
        assert {c.__name__ for c in classes} == {"Block"}
    source = (result.folder / "model.py").read_text()
    forward = source[source.index(f"class {result.class_name}("):]
    assert all(f'getattr(self.layers, "{i}")(' in forward for i in range(3))
    assert "self.layers, \"0\").fc1" not in forward  # the root reads no block's state


@pytest.mark.parametrize("name", ["default", "min"])
def test_state_dict_keys_order_and_shapes_are_the_originals(stacks, name):
    model, _, _, _, exported = stacks[name]
    expected = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    got = {k: (v.shape, v.dtype) for k, v in exported.state_dict().items()}
    assert list(got) == list(expected) and got == expected
    for path in BLOCKS:  # each block holds its own parameters
        assert ([n for n, _ in exported.get_submodule(path).named_parameters()]
                == [n for n, _ in model.get_submodule(path).named_parameters()])


@pytest.mark.parametrize("name", ["default", "min"])
def test_outputs_and_gradients_equal_the_optimized_modules(stacks, name):
    _, x, slim, _, exported = stacks[name]
    report = fxopt.verify(slim, exported, (x,))
    assert report.ok, report
    assert report.checked["param_grad"] == len(list(slim.parameters()))


def test_regions_inside_blocks_are_attached_to_the_exported_blocks(stacks):
    _, _, slim, result, exported = stacks["min"]
    assert result.regions > 0

    def regions(module: nn.Module) -> dict[str, set[str]]:
        return {path: {k for k, v in vars(module.get_submodule(path)).items()
                       if type(v).__name__ == "CheckpointedRegion"} for path in BLOCKS}

    assert regions(exported) == regions(slim)
    assert any(regions(slim).values())
    assert "_runtime_fxopt_runtime_regions.py" in result.files


@pytest.mark.parametrize("name", ["default", "min"])
def test_eval_mode_computes_the_users_eval_output(stacks, name):
    model, x, _, _, exported = stacks[name]
    model.eval(), exported.eval()
    try:
        with torch.no_grad():
            torch.testing.assert_close(exported(x), model(x), rtol=0, atol=0)
    finally:
        model.train(), exported.train()


def test_fsdp2_shards_the_exported_module_per_block(stacks, tmp_path):
    """As torchtitan does: ``fully_shard`` each block, then the root (one process, gloo). A
    root that read a block's parameters itself fails at the first forward."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    _, x, _, result, _ = stacks["default"]

    def step(module):
        torch.manual_seed(1)
        out = module(x)
        out.square().mean().backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in module.named_parameters()}
        return out.detach(), grads

    expected = step(load_exported(result.folder).load())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        sharded = load_exported(result.folder).load()
        for path in BLOCKS:
            fully_shard(sharded.get_submodule(path))
        fully_shard(sharded)
        got = step(sharded)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert list(got[1]) == list(expected[1])
    for key, grad in expected[1].items():
        torch.testing.assert_close(got[1][key], grad, rtol=0, atol=0)


class _GraphModulesAsLeaves(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, fx.GraphModule) or super().is_leaf_module(module, name)


def _traced(module: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(module, _GraphModulesAsLeaves().trace(module),
                          class_name=type(module).__name__)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.ModuleList([_traced(Residual()), _traced(Residual())])
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale):
        for module in self.inner:
            x = module(x, scale)
        return self.fc(x)


class Nested(Residuals):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_traced(Outer()), _traced(Outer())])


def test_graph_modules_nested_in_blocks_are_classes_of_their_own(tmp_path):
    """keep_blocks nests one level; a graph module a block's graph calls is written the same way."""
    root = _traced(Nested())
    x = torch.randn(3, 4)
    result = export(root, tmp_path / "out", example_inputs=(x,))
    assert result.verification.ok
    exported = load_exported(tmp_path / "out").load()
    assert type(exported.get_submodule("layers.1")).__name__ == "Outer"
    inner = [type(exported.get_submodule(f"layers.{i}.inner.{j}")) for i in (0, 1) for j in (0, 1)]
    assert len(set(inner)) == 1 and inner[0].__name__ == "Residual"
    assert list(exported.state_dict()) == list(root.state_dict())


def test_a_block_with_hooks_is_a_clear_error(tmp_path):
    x = torch.randn(3, 4)
    slim = fxopt.optimize(Residuals(), (x,), passes=[])
    slim.layers[1].register_forward_hook(lambda *_: None)
    with pytest.raises(ExportError, match=r"layers\.1 .*has hooks"):
        export(slim, tmp_path / "out", example_inputs=(x,))
    assert not (tmp_path / "out").exists()
