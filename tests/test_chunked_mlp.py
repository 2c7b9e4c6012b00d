"""The ``chunked_mlp`` pass and its runtime call (issue 36, item 3): a transformer MLP computed
over chunks of tokens, its wide intermediate never saved, and recomputed chunk by chunk in
backward.

- the call against the plain MLP: float64 equality of output and every gradient (gated and not,
  biases or not, each activation, many chunks, frozen weights, a second backward); bfloat16 and
  autocast within the plain MLP's own rounding of a float64 reference;
- memory, counted exactly (``LiveStorageTracker``): forward keeps nothing of the intermediate's
  width for backward, and backward's transient is one chunk;
- the pass: golden graphs (a gated and a GELU MLP rewritten; an MLP with a hook, dropout between
  the projections, an intermediate used twice, a narrowing MLP left alone), and it acts only
  under ``memory_budget="min"``;
- a Hugging Face Llama optimized at ``"min"``: every layer's MLP rewritten, verified, and trained
  step for step like the original; fxopt's own work under a default device of ``meta`` in
  bfloat16 (a tensor made on the wrong device fails here as it would on a GPU).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxopt
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.passes import chunked_mlp as chunked_mlp_pass
from fxopt.runtime.chunked_mlp import _mlp, chunk_rows, chunked_mlp
from fxopt.runtime.regions import CheckpointedRegion
from fxopt.passes.checkpoint import apply_plan
from fxopt.planning.solver import FULL, SELECTIVE, CheckpointPlan, Region
from device_mode import default_device_elsewhere
from helpers import assert_same_step, check_pass, step_record

WIDTH, INNER = 8, 24


def _weights(gated: bool, bias: bool, dtype=torch.float64, requires_grad=True):
    torch.manual_seed(0)

    def make(*shape):
        return (torch.randn(*shape, dtype=dtype) / shape[-1] ** 0.5).requires_grad_(requires_grad)

    return [make(INNER, WIDTH), make(INNER) if bias else None,
            make(INNER, WIDTH) if gated else None, make(INNER) if bias and gated else None,
            make(WIDTH, INNER), make(WIDTH) if bias else None]


def _step(fn, x, weights, grad):
    inputs = [t for t in (x, *weights) if t is not None and t.requires_grad]
    out = fn(x, weights)
    return (out, *torch.autograd.grad(out, inputs, grad))


@pytest.mark.parametrize("activation", ["silu", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("gated, bias", [(True, False), (True, True), (False, True),
                                         (False, False)])
def test_the_call_equals_the_plain_mlp_in_float64(activation, gated, bias):
    weights = _weights(gated, bias)
    x = torch.randn(3, 7, WIDTH, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 7, WIDTH, dtype=torch.float64)
    expected = _step(lambda x, w: _mlp(x, *w, activation), x, weights, grad)
    got = _step(lambda x, w: chunked_mlp(x, *w, activation, 4), x, weights, grad)  # 6 chunks
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_frozen_weights_an_input_without_grad_and_a_second_backward():
    weights = _weights(True, True)
    weights[0].requires_grad_(False)  # a frozen gate projection: no gradient made for it
    x = torch.randn(2, 5, WIDTH, dtype=torch.float64)  # an input that needs no gradient
    out = chunked_mlp(x, *weights, "silu", 3)
    reference = _mlp(x, *weights, "silu")
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, [w for w in weights if w.requires_grad], grad,
                                retain_graph=True)
    second = torch.autograd.grad(out, [w for w in weights if w.requires_grad], grad)
    expected = torch.autograd.grad(reference, [w for w in weights if w.requires_grad], grad)
    for a, b, c in zip(first, second, expected, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # without grad: the plain MLP, no autograd function
        assert chunked_mlp(x, *weights, "silu", 3).grad_fn is None


@pytest.mark.parametrize("dtype, autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_low_precision_is_as_close_to_float64_as_the_plain_mlp(dtype, autocast):
    """bfloat16 weights, and float32 under bfloat16 autocast: the call's output and gradients
    are about as close to a float64 reference as the plain MLP's own (a weight gradient is
    rounded once per chunk: two chunks here)."""
    weights64 = _weights(True, True)
    torch.manual_seed(1)
    x64 = torch.randn(4, 64, WIDTH, dtype=torch.float64)
    grad64 = torch.randn(4, 64, WIDTH, dtype=torch.float64)
    reference = _step(lambda x, w: _mlp(x, *w, "silu"), x64.requires_grad_(), weights64, grad64)

    def run(fn):
        weights = [w.detach().to(dtype).requires_grad_() for w in weights64]
        x = x64.detach().to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = _step(fn, x, weights, grad64.to(torch.bfloat16 if autocast else dtype))
        assert [t.dtype for t in got[1:]] == [dtype] * len(got[1:])
        return [t.double() for t in got]

    plain = run(lambda x, w: _mlp(x, *w, "silu"))
    chunked = run(lambda x, w: chunked_mlp(x, *w, "silu", 32))
    for ref, a, b in zip(reference, plain, chunked, strict=True):
        plain_error = (a - ref).norm() / ref.norm()
        assert (b - ref).norm() / ref.norm() <= 1.5 * plain_error + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tensor_the_call_makes_is_on_its_inputs_device(dtype):
    """Forward and backward on ``meta`` tensors while the default device is the CPU: a tensor
    made without naming a device lands on the CPU and the next op mixing it with the inputs
    raises, as a CPU tensor in a CUDA model's backward does (the backward runs in autograd's
    engine, outside ``default_device_elsewhere``'s reach)."""
    weights = [None if w is None else w.detach().to("meta", dtype).requires_grad_()
               for w in _weights(True, True)]
    x = torch.randn(4, 16, WIDTH, device="meta", dtype=dtype, requires_grad=True)
    out = chunked_mlp(x, *weights, "silu", 8)
    out.backward(torch.ones_like(out))
    assert out.device.type == x.grad.device.type == "meta"
    assert all(w.grad.device.type == "meta" and w.grad.dtype == dtype for w in weights)


def _held_after_forward(fn, x, weights) -> int:
    with LiveStorageTracker() as tracker:
        out = fn(x, weights)
    held = tracker.current_bytes - out.untyped_storage().nbytes()
    del out
    return held


def test_forward_keeps_nothing_as_wide_as_the_intermediate_and_backward_holds_a_chunk():
    weights = _weights(True, False, dtype=torch.float32)
    tokens = 512
    x = torch.randn(tokens, WIDTH, requires_grad=True)
    intermediate_bytes = tokens * INNER * 4
    plain = _held_after_forward(lambda x, w: _mlp(x, *w, "silu"), x, weights)
    held = _held_after_forward(lambda x, w: chunked_mlp(x, *w, "silu", 1), x, weights)
    assert plain >= 3 * intermediate_bytes  # gate, up, silu(gate) (and their product)
    assert held == 0  # x and the weights are the caller's: nothing new is kept

    rows = chunk_rows(tokens, WIDTH, INNER, 1)
    assert rows == math.ceil(tokens * WIDTH / INNER)  # each chunk's intermediate: x's size
    out = chunked_mlp(x, *weights, "silu", 1)
    grad = torch.randn_like(out)
    with LiveStorageTracker() as tracker:
        out.backward(grad)
    gradients = x.numel() * 4 + sum(w.numel() * 4 for w in weights if w is not None)
    # beyond the gradients: five intermediate-wide tensors of one chunk at most, never one of
    # the whole batch
    transient = tracker.peak_bytes - gradients
    assert transient <= 5 * rows * INNER * 4 + rows * WIDTH * 4 < 2 * intermediate_bytes


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(WIDTH, INNER, bias=False)
        self.up = nn.Linear(WIDTH, INNER, bias=False)
        self.down = nn.Linear(INNER, WIDTH, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.down(self.act(self.gate(x)) * self.up(x))


class MLPs(nn.Module):
    """A gated MLP and a GELU one (rewritten); a hooked, a dropout, a reused and a narrowing
    MLP (left alone)."""

    def __init__(self):
        super().__init__()
        self.gated = Gated()
        self.fc1, self.fc2 = nn.Linear(WIDTH, INNER), nn.Linear(INNER, WIDTH)
        self.hooked = nn.Sequential(nn.Linear(WIDTH, INNER), nn.ReLU(), nn.Linear(INNER, WIDTH))
        self.hooked[0].register_forward_hook(lambda module, args, out: None)
        self.drop_in, self.drop_out = nn.Linear(WIDTH, INNER), nn.Linear(INNER, WIDTH)
        self.drop = nn.Dropout(0.0)
        self.used_in, self.used_out = nn.Linear(WIDTH, INNER), nn.Linear(INNER, WIDTH)
        self.narrow_in, self.narrow_out = nn.Linear(WIDTH, 4), nn.Linear(4, WIDTH)

    def forward(self, x):
        x = self.gated(x)
        x = x + self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        x = x + self.hooked(x)
        x = x + self.drop_out(self.drop(F.relu(self.drop_in(x))))
        used = F.silu(self.used_in(x))
        x = x + self.used_out(used) + used.mean()
        return x + self.narrow_out(F.relu(self.narrow_in(x)))


MLPS_AFTER = """
    x = input
    gated_gate_weight = @gated.gate.weight()
    gated_up_weight = @gated.up.weight()
    gated_down_weight = @gated.down.weight()
    chunked_mlp = chunked_mlp(x, gated_gate_weight, None, gated_up_weight, None, \
gated_down_weight, None, 'silu', 4)
    add = add(x, chunked_mlp)
    fc1_weight = @fc1.weight()
    fc1_bias = @fc1.bias()
    fc2_weight = @fc2.weight()
    fc2_bias = @fc2.bias()
    chunked_mlp_1 = chunked_mlp(add, fc1_weight, fc1_bias, None, None, fc2_weight, fc2_bias, \
'gelu_tanh', 4)
    add_1 = add(add, chunked_mlp_1)
    hooked_0 = hooked.0:Linear(add_1)
    hooked_1 = hooked.1:ReLU(hooked_0)
    hooked_2 = hooked.2:Linear(hooked_1)
    add_2 = add(add_1, hooked_2)
    drop_in = drop_in:Linear(add_2)
    relu = relu(drop_in, inplace=False)
    drop = drop:Dropout(relu)
    drop_out = drop_out:Linear(drop)
    add_3 = add(add_2, drop_out)
    used_in = used_in:Linear(add_3)
    silu = silu(used_in, inplace=False)
    used_out = used_out:Linear(silu)
    add_4 = add(add_3, used_out)
    mean = .mean(silu)
    add_5 = add(add_4, mean)
    narrow_in = narrow_in:Linear(add_5)
    relu_1 = relu(narrow_in, inplace=False)
    narrow_out = narrow_out:Linear(relu_1)
    add_6 = add(add_5, narrow_out)
    return add_6
""".replace("\\\n", "")


def test_golden_graphs_of_the_mlps_rewritten_and_left_alone():
    torch.manual_seed(0)
    model = MLPs()
    inputs = (torch.randn(2, 16, WIDTH),)
    _, result = check_pass(model, inputs, chunked_mlp_pass,
                           options={"budget": "min", "min_rows": 4}, golden_after=MLPS_AFTER)
    assert result.stats["rewritten"] == 2
    first = result.stats["sites"][0]
    assert (first["gated"], first["intermediate"], first["tokens"], first["rows_per_chunk"]) \
        == (True, INNER, 32, 11)
    # a fraction of activation memory (or no budget) leaves every MLP as it is
    for options in ({"budget": 0.5}, {}):
        _, result = check_pass(model, inputs, chunked_mlp_pass, options=options,
                               expect_modified=False, numerics=False)
        assert "memory_budget='min'" in result.stats["skipped"]
    with pytest.raises(fxopt.ConfigError, match="min_rows"):
        chunked_mlp_pass(fxopt.trace(model, inputs), force=True, min_rows=0)


def _llama(transformers):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        use_cache=False))


def test_a_hugging_face_llama_at_min_trains_like_the_original():
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    kwargs = {"input_ids": ids, "labels": ids}
    passes = ["causal_attention", "chunked_loss", ("chunked_mlp", {"min_rows": 16}),
              "checkpoint"]
    gm = fxopt.optimize(model, (), example_kwargs=kwargs, memory_budget="min", passes=passes)
    record = next(p for p in gm.fxopt_report.passes if p.name == "chunked_mlp")
    assert record.stats["rewritten"] == 2 and record.stats["sites"][0]["rows_per_chunk"] == 32  # 3 chunks
    assert gm.fxopt_report.verification.ok
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, gm)]
    for _ in range(2):
        for module, optimizer in zip((reference, gm), optimizers):
            module(**kwargs).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_bfloat16_work_makes_no_tensor_on_the_default_device():
    """The pass, the plan around the call, verification and a training step, in bfloat16 with
    the default device elsewhere (``meta``): every tensor the call makes follows its inputs."""
    torch.manual_seed(0)
    model = NormedBlock().to(torch.bfloat16)
    x = torch.randn(2, 16, WIDTH, dtype=torch.bfloat16)
    with default_device_elsewhere():
        gm = fxopt.optimize(model, x, memory_budget="min",
                            passes=[("chunked_mlp", {"min_rows": 4}), "checkpoint"])
        gm(x.requires_grad_()).float().square().sum().backward()
    assert next(p for p in gm.fxopt_report.passes if p.name == "chunked_mlp").modified
    assert gm.fxopt_report.verification.ok
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in gm.parameters())
    assert x.grad is not None and x.grad.device.type == "cpu"


class NormedBlock(nn.Module):
    """A pre-norm residual block around the gated MLP, then a head."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = Gated()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.head(self.mlp(self.norm(x)))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_inside_a_checkpointed_region_the_call_trains_like_the_plain_mlp(mode):
    """A region over the norm, the chunked call and the residual add: recomputed in full, or
    selectively keeping the call's output (the cost model calls the node heavy: it runs
    matmuls), its backward still recomputes its chunks from the input the region rebuilds."""
    torch.manual_seed(0)
    model = NormedBlock()
    x = torch.randn(2, 16, WIDTH, requires_grad=True)
    gm = fxopt.trace(model, x)
    assert chunked_mlp_pass(gm, force=True, min_rows=4).modified
    forward = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    call = next(i for i, n in enumerate(forward) if n.target is chunked_mlp)
    kept = (call,) if mode == "selective" else ()
    region = Region(0, call + 2, FULL if mode == "full" else SELECTIVE, 0.0, 0, kept=kept,
                    random=False)
    apply_plan(gm, forward, CheckpointPlan([region]))
    gm.recompile()
    bodies = [v.body for v in vars(gm).values() if isinstance(v, CheckpointedRegion)]
    assert [n.target for b in bodies for n in b.graph.nodes].count(chunked_mlp) == 1
    assert_same_step(step_record(gm, x), step_record(model, x))


def test_an_exported_module_calls_its_own_copy_of_the_chunked_mlp(tmp_path):
    """``fxopt.export`` copies the runtime module next to the generated code (where fxopt is
    not installed), verifies the folder against the optimized module, and the loaded model's
    step is the original's."""
    from fxopt.export.writer import export, load_exported

    torch.manual_seed(0)
    model = NormedBlock()
    x = torch.randn(2, 16, WIDTH)
    gm = fxopt.optimize(model, x, passes=[("chunked_mlp", {"force": True, "min_rows": 4})])
    assert next(p for p in gm.fxopt_report.passes if p.name == "chunked_mlp").modified
    export(gm, tmp_path / "out", example_inputs=(x,))
    copied = [p.name for p in (tmp_path / "out").rglob("*chunked_mlp*.py")]
    assert copied, sorted(p.name for p in (tmp_path / "out").rglob("*.py"))
    code = (tmp_path / "out" / "model.py").read_text()
    assert "chunked_mlp(" in code and "fxopt.runtime" not in code
    loaded = load_exported(tmp_path / "out").load()
    assert_same_step(step_record(loaded, x.requires_grad_()), step_record(model, x))


def test_torch_compile_traces_the_call_as_the_plain_mlp_without_a_graph_break():
    torch.manual_seed(0)
    model = NormedBlock()
    x = torch.randn(2, 16, WIDTH)
    gm = fxopt.optimize(model, x, passes=[("chunked_mlp", {"force": True, "min_rows": 4})],
                        verify=False, predict_memory=False)
    torch.compiler.reset()
    try:
        assert torch._dynamo.explain(gm)(x).graph_break_count == 0
        compiled = torch.compile(gm, backend="aot_eager")
        assert_same_step(step_record(gm, x, call=compiled), step_record(model, x))
    finally:
        torch.compiler.reset()
