"""capture_with_export: torch.export as a frontend for models symbolic tracing cannot follow."""

from __future__ import annotations

import collections
import copy
import functools
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxopt.capture.export_frontend import ExportInfo, capture_with_export
from fxopt.capture.reuse import editable_copy
from fxopt.capture.trace import trace
from fxopt.core.errors import InputError, TraceError
from fxopt.graph.train_eval import eval_graph
from fxopt.verify import verify

VOCAB, WIDTH, HEADS = 61, 32, 4
aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, width: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(p))
        self.drop = nn.Dropout(p)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.p if self.training else 0.0)
        h = h + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, C)))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    """A hand-written GPT: the causal mask is built from the input's length in the root forward."""

    def __init__(self, width: int = WIDTH, layers: int = 2, max_len: int = 32):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(max_len, width)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block(width, HEADS) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        h = self.drop(self.tok(idx) + self.pos(torch.arange(T, device=idx.device)))
        mask = torch.tril(torch.ones(T, T, device=idx.device)).bool()
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln_f(h))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, VOCAB, (4, 8))
    return model, idx, capture_with_export(model, (idx,))


def seeded(module: nn.Module, *args, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return module(*args, **kwargs)


def test_gpt_is_captured_as_aten_ops_without_leaves(gpt):
    model, idx, gm = gpt
    with pytest.raises(TraceError):
        trace(model, (idx,))
    assert type(gm) is not type(model) and isinstance(gm, torch.fx.GraphModule)
    info = gm.meta["fxopt_trace"]
    assert info.leaves == [] and info.mode_dependent
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {aten.scaled_dot_product_attention.default, aten.tril.default, aten.gelu.default,
            aten.layer_norm.default, aten.dropout.default, aten.embedding.default} <= targets
    for node in gm.graph.nodes:
        if node.op != "output":
            assert "val" in node.meta, node
    (out,) = gm.graph.find_nodes(op="output")
    assert tuple(out.args[0].meta["val"].shape) == (4, 8, VOCAB)


def test_parameters_and_state_dict_are_the_users(gpt):
    model, _, gm = gpt
    ours, theirs = dict(gm.named_parameters()), dict(model.named_parameters())
    assert list(ours) == list(theirs)
    assert all(ours[name] is theirs[name] for name in theirs)
    assert gm.head.weight is gm.tok.weight is model.tok.weight
    assert [(k, v.shape) for k, v in gm.state_dict().items()] == \
        [(k, v.shape) for k, v in model.state_dict().items()]
    optimizer = torch.optim.SGD(gm.parameters(), lr=0.1)
    assert all(any(p is q for q in model.parameters())
               for group in optimizer.param_groups for p in group["params"])


def test_outputs_and_gradients_equal_the_models_with_dropout_active(gpt):
    model, idx, gm = gpt
    report = verify(model, gm, (idx,))
    assert report.ok, str(report)
    assert report.checked["param_grad"] == len(list(model.parameters()))
    assert report.checked["eval_output"] == 1
    # dropout really runs in the captured graph: another seed gives another output
    assert torch.equal(seeded(gm, idx, seed=1), seeded(model, idx, seed=1))
    assert not torch.equal(seeded(gm, idx, seed=1), seeded(gm, idx, seed=2))


def test_batch_and_length_are_dynamic_and_a_batch_of_one_is_served(gpt):
    model, idx, gm = gpt
    info = gm.meta["fxopt_export"]
    assert info.dynamic == ("idx.shape[0]", "idx.shape[1]") and info.batch_of_one
    for shape in [(3, 8), (4, 7), (2, 32), (1, 8), (1, 5)]:
        other = torch.randint(0, VOCAB, shape)
        assert torch.equal(seeded(gm, other), seeded(model, other)), shape
    with pytest.raises(InputError) as error:  # a length of 1 is traced apart: refused
        gm(torch.randint(0, VOCAB, (4, 1)))
    assert error.value.where.endswith("idx.shape[1]") and "in [2, inf]" in error.value.what
    with pytest.raises(InputError, match="dtype"):
        gm(idx.to(torch.int32))


def test_every_trace_runs_without_the_fake_tensor_cache(monkeypatch):
    """Under symbolic sizes FakeTensor's cache can cost more than it saves (up to a quarter of a
    small Hugging Face model's capture): each torch.export trace turns it off, and it is back on
    afterwards for the predictions, which run at static sizes where it pays."""
    import torch._dynamo.config as dynamo_config

    seen, export = [], torch.export.export

    def recording(*args, **kwargs):
        seen.append(dynamo_config.fake_tensor_cache_enabled)
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", recording)
    torch.manual_seed(0)
    capture_with_export(GPT(layers=1), (torch.randint(0, VOCAB, (4, 8)),))
    assert len(seen) >= 3 and not any(seen), seen  # train, eval, a batch of one
    assert dynamo_config.fake_tensor_cache_enabled


class FixedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).reshape(4, 2, 3).sum(1)  # a batch of 4, written into the model


def test_a_batch_size_the_model_fixes_stays_fixed():
    model, x = FixedBatch(), torch.randn(4, 6)
    gm = capture_with_export(model, (x,))
    assert gm.meta["fxopt_export"].dynamic == ()
    assert torch.equal(gm(x), model(x))
    with pytest.raises(InputError, match=r"x.shape\[0\] == 4 only"):
        gm(torch.randn(2, 6))


# -- a Hugging Face style model: decorated forward, keyword inputs, a loss, a dict-like output


class CausalLMOutput(collections.OrderedDict):
    pass


def default_attention_mask(forward):
    """Like Hugging Face's forward decorators: ``*args, **kwargs`` around the real forward."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        if kwargs.get("attention_mask") is None:
            batch, length = input_ids.shape
            kwargs["attention_mask"] = torch.ones(batch, length, dtype=torch.long,
                                                  device=input_ids.device)
        return forward(self, *args, **kwargs)
    return wrapper


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(0.2)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    @default_attention_mask
    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids) * attention_mask[..., None]
        logits = self.lm_head(self.drop(self.ln(h)))
        out = CausalLMOutput(logits=logits)
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    return TinyLM(), ids, mask, torch.randint(0, VOCAB, (2, 5))


def test_decorated_forward_symbolic_tracing_fails_export_captures(tiny_lm):
    model, ids, _, _ = tiny_lm
    with pytest.raises(TraceError):
        trace(model, (ids,))
    gm = capture_with_export(model, (ids,))
    out = seeded(gm, ids)
    assert type(out) is CausalLMOutput and list(out) == ["logits"]
    assert torch.equal(out["logits"], seeded(model, ids)["logits"])
    with pytest.raises(TypeError):  # captured without labels: the graph does not take them
        gm(ids, labels=ids)


def test_keyword_inputs_loss_and_output_type(tiny_lm):
    model, ids, mask, labels = tiny_lm
    gm = capture_with_export(model, (ids,), {"attention_mask": mask, "labels": labels})
    out = seeded(gm, ids, attention_mask=mask, labels=labels)
    expected = seeded(model, ids, attention_mask=mask, labels=labels)
    assert type(out) is CausalLMOutput and list(out) == ["logits", "loss"]
    assert all(torch.equal(out[k], expected[k]) for k in expected)

    grads = []
    for module, result in ((model, expected), (gm, out)):
        module.zero_grad(set_to_none=True)
        result["loss"].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n]) for n in grads[0])

    positional = seeded(gm, ids, mask, labels)
    assert torch.equal(positional["loss"], expected["loss"])
    with pytest.raises(InputError, match="labels a tensor"):
        gm(ids, attention_mask=mask, labels=None)
    with pytest.raises(TypeError):
        gm(ids, attention_mask=mask)
    with pytest.raises(InputError, match=r"labels.shape\[0\] = 1") as error:
        gm(ids, attention_mask=mask, labels=labels[:1])  # the loss pairs logits with labels
    assert "torch.export recorded this condition while tracing forward" in error.value.what


@dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple
    extra: dict


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, inputs: dict, scale: float = 1.0):
        h1 = self.a(inputs["x"]) * scale
        h2 = self.b(h1 + inputs["y"])
        return Output(logits=h2, hidden=(h1, Pair(h1, h2)), extra={"note": None, "n": 2})


def test_nested_inputs_and_dataclass_namedtuple_outputs():
    model = Structured()
    inputs = {"x": torch.randn(3, 4), "y": torch.randn(3, 4)}
    gm = capture_with_export(model, (inputs, 0.5))
    out, expected = gm(inputs, 0.5), model(inputs, 0.5)
    assert type(out) is Output and type(out.hidden[1]) is Pair and type(out.hidden) is tuple
    assert out.extra == {"note": None, "n": 2}
    assert torch.equal(out.logits, expected.logits)
    assert torch.equal(out.hidden[1].first, expected.hidden[1].first)
    with pytest.raises(InputError, match="scale=0.5"):
        gm(inputs, 1.0)
    with pytest.raises(InputError, match="keys"):
        gm({"x": inputs["x"]}, 0.5)


# -- training modes, the user's model untouched, failures


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)
        self.notes: list = []  # a plain attribute: export replaces these with copies

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


def test_train_and_eval_dispatch_with_dropout_and_batchnorm():
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(6, 8)
    gm = capture_with_export(model, (x,))
    reference = copy.deepcopy(model)
    assert gm.meta["fxopt_trace"].mode_dependent
    assert dict(gm.named_buffers())["bn.running_mean"] is model.bn.running_mean

    gm.train()
    reference.train()
    assert torch.equal(seeded(gm, x, seed=3), seeded(reference, x, seed=3))
    assert not torch.equal(seeded(gm, x, seed=4), seeded(reference, x, seed=3))
    for name, buffer in reference.named_buffers():  # 2 calls each: stats updated alike
        assert torch.allclose(buffer, dict(model.named_buffers())[name]), name
    stats = model.bn.running_mean.clone()

    gm.eval()
    reference.eval()
    assert not gm.training and not gm.bn.training
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x)) and torch.equal(gm(x), gm(x))
    assert torch.equal(model.bn.running_mean, stats)


def test_the_users_model_is_unchanged():
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(6, 8)
    model.eval()
    model.drop.train()
    model.fc1.weight.grad = grad = torch.ones_like(model.fc1.weight)
    flags = {name: m.training for name, m in model.named_modules()}
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    notes, rng = model.notes, torch.get_rng_state()

    gm = capture_with_export(model, (x,))

    assert {name: m.training for name, m in model.named_modules()} == flags
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.fc1.weight.grad is grad and model.fc2.weight.grad is None
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.notes is notes and torch.equal(torch.get_rng_state(), rng)
    assert not gm.training  # the captured module starts in the model's mode


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls = self.calls + 1  # torch.export drops this update
        return self.lin(x)


def test_failures_are_trace_errors_with_a_place_and_a_hint():
    x = torch.randn(2, 4)
    with pytest.raises(TraceError) as error:
        capture_with_export(DataDependent(), (x,))
    assert "test_export_frontend.py" in error.value.where and "if x.sum() > 0" in \
        error.value.where
    assert "capture='fx'" in error.value.hint and "opaque leaf" in error.value.hint

    with pytest.raises(TraceError, match="'calls'"):
        capture_with_export(Counter(), (x,))

    hooked = Classifier()
    hooked.fc1.register_forward_hook(lambda module, args, out: None)
    with pytest.raises(TraceError, match="forward hooks") as error:
        capture_with_export(hooked, (torch.randn(4, 8),))
    assert error.value.where.startswith("fc1")

    with pytest.raises(InputError):
        capture_with_export(Classifier(), (torch.randn(4, 8), torch.randn(4, 8)))


class UserCheckpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.reentrant = reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_users_checkpoint_is_refused_not_inlined(reentrant):
    with pytest.raises(TraceError, match="torch.utils.checkpoint, which torch.export would "
                                         "inline") as error:
        capture_with_export(UserCheckpointed(reentrant), (torch.randn(3, 4),))
    assert "test_export_frontend.py" in error.value.where and "capture='fx'" in error.value.hint


# -- fxopt's passes on the ATen graph


def test_checkpoint_and_inplace_passes_on_the_captured_graph(gpt):
    from fxopt.passes.checkpoint import checkpoint
    from fxopt.passes.inplace_activations import inplace_activations

    model, idx, captured = gpt  # GPT() and a (4, 8) batch drawn after seed 0
    gm = editable_copy(captured)  # as optimize(captured=...) copies a capture
    code, eval_code = captured.code, str(eval_graph(captured))

    result = inplace_activations(gm)
    assert verify(model, result.graph_module, (idx,)).ok

    # plan from the cost model: fast, and the same in every process (tests/test_plan_determinism)
    result = checkpoint(gm, budget=0.8, profile=False)
    assert result.modified and result.stats["regions_count"] >= 1
    assert result.stats["predicted_after"] <= result.stats["budget_bytes"]
    report = verify(model, result.graph_module, (idx,))
    assert report.ok, str(report)
    other = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(seeded(result.graph_module, other), seeded(model, other))  # dynamic batch
    # the passes rewrote the copy: the fixture's capture, which other tests read, is as it was
    assert captured.code == code and str(eval_graph(captured)) == eval_code


# -- optimizing a captured module again


class FixedLengthGPT(GPT):
    """The whole position table is added: the model fixes the length, so the graph builds its
    causal mask from constant sizes; in eval mode it scales by a tensor it makes from a literal,
    which torch.export lifts out as a constant only the eval graph reads."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        h = self.drop(self.tok(idx) + self.pos.weight)
        if not self.training:
            h = h * torch.tensor([1.0, 1.0, 1.0, 1.0] * (h.shape[-1] // 4), device=idx.device)
        mask = torch.tril(torch.ones(T, T, device=idx.device)).bool()
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln_f(h))


def test_rebuilt_modules_keep_the_constants_only_the_eval_graph_reads():
    """A module rebuilt from the train graph (checkpoint's candidates, reorder's schedules) must
    carry the tensor constants only the eval graph reads, or eval mode fails. (Re-tracing with
    torch.fx once turned the eval graph's arange/tril of constant sizes into constants of their
    own; since their device follows a parameter (fxopt.capture.export_devices), they stay ops,
    so the eval graph's constant here is one torch.export lifted from an eval-only branch.)"""
    from fxopt.graph.graphs import graph_module_like
    from fxopt.graph.train_eval import eval_graph
    from fxopt.core.torch_private import copy_codegen

    torch.manual_seed(0)
    model = FixedLengthGPT(layers=1, max_len=8)  # the constant is the root's: one block will do
    idx = torch.randint(0, VOCAB, (4, 8))
    gm = capture_with_export(model, (idx,))
    assert gm.meta["fxopt_export"].dynamic == ("idx.shape[0]",)
    traced = trace(gm, (idx,))
    train_reads = {n.target for n in traced.graph.find_nodes(op="get_attr")}
    eval_only = {n.target for n in eval_graph(traced).find_nodes(op="get_attr")} - train_reads
    assert eval_only, "the eval graph reads no constant of its own: the test proves nothing"
    graph = torch.fx.Graph()
    copy_codegen(traced.graph, graph)
    graph.output(graph.graph_copy(traced.graph, {}))
    rebuilt = graph_module_like(traced, graph)
    assert all(getattr(rebuilt, name) is getattr(traced, name) for name in eval_only)
    assert set(rebuilt.state_dict()) == set(model.state_dict())  # constants are not state
    rebuilt.eval()
    model.eval()
    try:
        with torch.no_grad():
            assert torch.equal(rebuilt(idx), model(idx))
    finally:
        model.train()


def test_optimizing_an_exported_module_with_a_memory_budget():
    """The reported bug: the checkpoint pass lost '_tensor_constant*' of the eval graph."""
    import fxopt

    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, VOCAB, (4, 16))  # 0.5 fits with room to spare (8 would be tight)
    gm = capture_with_export(model, (idx,))
    optimized = fxopt.optimize(gm, (idx,), memory_budget=0.7)
    checkpoint = next(p for p in optimized.fxopt_report.passes if p.name == "checkpoint")
    assert checkpoint.modified and optimized.fxopt_report.verification.ok
    assert verify(model, optimized, (idx,)).ok


def test_the_guard_is_a_runtime_object_that_pickles(gpt):
    import pickle

    from fxopt.runtime.input_guard import InputGuard

    _, idx, gm = gpt
    guard = gm._fxopt_input_guard  # the train graph's (the eval graph has one of its own)
    assert isinstance(guard, InputGuard)
    assert type(guard).__module__ == "fxopt.runtime.input_guard"
    copy = pickle.loads(pickle.dumps(guard))
    assert copy == guard and hash(copy) == hash(guard)
    with pytest.raises(InputError, match=r"idx.shape\[1\] in \[2, inf\]"):
        copy(torch.randint(0, VOCAB, (4, 1)))
    assert copy(idx) is None
