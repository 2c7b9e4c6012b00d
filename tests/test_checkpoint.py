"""passes.checkpoint: budget adherence (measured), exact BN buffers, RNG replay, errors."""

import contextlib
import copy
import importlib
import io

import pytest
import torch
from helpers import check_pass, compact
from torch import nn

import fxopt
import fxopt.analysis.costmodel
import fxopt.runtime.region_frame
import fxopt.runtime.regions
from fxopt.analysis.estimate import estimate_train_peak
from fxopt.capture.trace import trace
from fxopt.core.errors import BudgetError
from fxopt.core.state import preserved_state
from fxopt.measure.peaks import measure_inference, measure_train_step
from fxopt.verify.equivalence import verify
from fxopt.passes.checkpoint import checkpoint
from fxopt.planning.checkpoint_search import least_memory_plan
from fxopt.core.training_setup import TrainingSetup

CHECKPOINT_PASS = importlib.import_module("fxopt.passes.checkpoint")  # the name is the pass's


def conv_stack(width: int = 12, depth: int = 6) -> nn.Module:
    """Activation-heavy: few parameters, large feature maps, BatchNorm and dropout."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1)]
    for _ in range(depth):
        layers += [nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(0.1),
                   nn.Conv2d(width, width, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 5))


@pytest.fixture(scope="module")
def model_and_input():
    torch.manual_seed(0)
    return conv_stack(), torch.randn(4, 3, 32, 32)


@pytest.mark.parametrize("fraction", [0.7, 0.4])
def test_measured_peak_within_budget_and_equivalent(model_and_input, fraction):
    model, x = model_and_input
    before = measure_train_step(trace(model, x), x)
    gm = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": fraction})])
    stats = gm.fxopt_report.passes[0].stats
    after = measure_train_step(gm, x)
    assert gm.fxopt_report.passes[0].modified
    assert after.peak_bytes <= stats["budget_bytes"] < before.peak_bytes
    assert stats["predicted_after"] == after.peak_bytes  # the fake-tensor prediction is exact
    assert gm.fxopt_report.verification.ok  # outputs, grads, BN buffers, dropout masks


def test_budget_fraction_is_of_the_activations_alive_at_the_peak(model_and_input):
    """Activation memory = live bytes at the training peak minus parameters, buffers, inputs and
    the gradients alive at that moment; a fraction f keeps f of it (issue 14, item 1)."""
    model, x = model_and_input
    before = measure_train_step(trace(model, x), x)
    predicted = estimate_train_peak(trace(model, x), x)
    # the prediction splits the peak as the measurement does (exact on CPU)
    assert (predicted.bytes, predicted.grad_bytes, predicted.activation_bytes) == (
        before.peak_bytes, before.grads_at_peak_bytes, before.activations_at_peak_bytes)
    gm = fxopt.optimize(model, x, memory_budget=0.5)
    stats = next(p.stats for p in gm.fxopt_report.passes if p.name == "checkpoint")
    assert stats["activation_bytes"] == before.activations_at_peak_bytes
    after = measure_train_step(gm, x)
    moved_grads = abs(after.grads_at_peak_bytes - before.grads_at_peak_bytes)
    assert after.activations_at_peak_bytes <= 0.5 * before.activations_at_peak_bytes + moved_grads


def test_byte_budget_string(model_and_input):
    model, x = model_and_input
    peak = measure_train_step(trace(model, x), x).peak_bytes
    budget = int(peak * 0.85)
    gm = fxopt.optimize(model, x, memory_budget=f"{budget}B")
    assert measure_train_step(gm, x).peak_bytes <= budget


def test_batchnorm_statistics_updated_once_and_planted_double_update_is_caught(
        model_and_input, monkeypatch):
    model, x = model_and_input
    gm = trace(model, x)
    checkpoint(gm, budget=0.4)
    gm.recompile()
    assert verify(model, gm, x).ok
    # Recomputing BatchNorm by calling the module (not over scratch statistics) updates the
    # running stats a second time:
    monkeypatch.setattr(fxopt.runtime.regions, "_PLAIN_BATCH_NORMS", ())
    report = verify(model, gm, x)
    assert not report.ok
    assert {m.kind for m in report.mismatches} == {"buffer"}
    assert any(m.name.endswith("num_batches_tracked") for m in report.mismatches)


def test_module_called_inside_and_outside_a_region_keeps_what_backward_saved():
    """A shared BatchNorm: its outside call saves ``running_mean`` for backward; recomputing the
    region (which calls it again) must not write that buffer, or backward raises 'modified by an
    inplace operation' (found by fuzz_long with pad_channels on 2026-11-23)."""
    torch.manual_seed(0)
    shared = nn.BatchNorm1d(4)

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = shared

        def forward(self, x):
            return self.bn(x).relu()

    region = fxopt.runtime.regions.CheckpointedRegion(torch.fx.symbolic_trace(Body()),
                                                      selective=False)
    reference = copy.deepcopy(shared)
    x = torch.randn(8, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    region(shared(x)).square().sum().backward()
    reference(reference(x_ref)).relu().square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(shared.weight.grad, reference.weight.grad)
    for name, buffer in shared.named_buffers():
        torch.testing.assert_close(buffer, reference.get_buffer(name), msg=name)


def test_impossible_budget_names_the_smallest_peak(model_and_input):
    model, x = model_and_input
    with pytest.raises(BudgetError) as info:
        fxopt.optimize(model, x, memory_budget=1000)
    smallest = info.value.smallest_bytes
    assert isinstance(smallest, int) and 1000 < smallest
    message = str(info.value)
    assert "smallest predicted training peak" in message
    assert f"{smallest:,} bytes" in message and f"at least {smallest} (bytes)" in info.value.hint
    assert "memory_budget='min'" in info.value.hint and "MiB" in message
    assert "fraction" in message
    assert fxopt.optimize(model, x, memory_budget=f"{smallest:,}", verify=False)  # pastes back
    gm = fxopt.optimize(model, x, memory_budget=smallest)  # the quoted figure is achievable
    assert measure_train_step(gm, x).peak_bytes <= smallest


def test_min_budget_is_the_least_memory_plan_and_never_a_budget_error(model_and_input):
    model, x = model_and_input
    with pytest.raises(BudgetError) as info:
        fxopt.optimize(model, x, memory_budget=1000)
    gm = fxopt.optimize(model, x, memory_budget="min")
    stats = next(p for p in gm.fxopt_report.passes if p.name == "checkpoint").stats
    assert stats["predicted_after"] == info.value.smallest_bytes == stats["budget_bytes"]
    assert gm.fxopt_report.verification.ok
    assert measure_train_step(gm, x).peak_bytes <= stats["predicted_after"]
    assert measure_train_step(gm, x).peak_bytes < measure_train_step(model, x).peak_bytes


class WideEmbeddingLast(nn.Module):
    """A vocabulary of 50,000 over a tiny body: the training peak comes at the end of backward,
    where the embedding's dense gradient is made, and no value saved for backward is alive."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50_000, 64)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    def forward(self, ids):
        return self.body(self.embedding(ids)).square().mean()


def test_a_peak_no_saved_value_is_alive_at_is_left_without_a_search(monkeypatch):
    torch.manual_seed(0)
    model, ids = WideEmbeddingLast(), torch.randint(0, 50_000, (2, 8))
    gm = trace(model, ids)
    estimate = estimate_train_peak(gm, ids)
    assert estimate.op == "embedding_dense_backward" and estimate.forward_bytes == 0
    assert not estimate.saved_values_at_peak
    # the search it skips finds nothing lower either
    problem, forward = CHECKPOINT_PASS.build_problem(gm, profile=False)
    found = least_memory_plan(problem, lambda plan: CHECKPOINT_PASS._predict(
        gm, forward, plan, TrainingSetup()), max_region_atoms=16)
    assert found is None or found[0] >= estimate.bytes

    def never(*args, **kwargs):
        raise AssertionError("no problem is built for a peak no region can lower")

    monkeypatch.setattr(CHECKPOINT_PASS, "build_problem", never)
    result = checkpoint(trace(model, ids), budget="min")
    assert not result.modified and "no plan was searched" in result.stats["reason"]
    assert result.stats["budget_bytes"] == result.stats["predicted_after"] == estimate.bytes
    with pytest.raises(BudgetError) as info:
        checkpoint(trace(model, ids), budget=0.5)
    assert info.value.smallest_bytes == estimate.bytes


class TiedHeadLM(nn.Module):
    """A vocabulary of 20,000 over a tiny body, the head tied to the embedding: once the loss is
    chunked, its backward passes on the head's weight gradient (made in forward, saved for
    backward), and the training peak comes where the embedding's own is added to it."""

    def __init__(self, vocab: int = 20_000, dim: int = 32):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids, targets):
        logits = self.head(self.body(self.embedding(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_saved_tensor_backward_has_taken_back_is_no_value_a_region_can_drop(monkeypatch):
    torch.manual_seed(0)
    model = TiedHeadLM()
    ids, targets = torch.randint(0, 20_000, (2, 256)), torch.randint(0, 20_000, (2, 256))
    chunked = fxopt.optimize(model, (ids, targets), verify=False, passes=["chunked_loss"])
    assert chunked.fxopt_report.passes[0].stats["rewritten"] == 1

    def never(*args, **kwargs):
        raise AssertionError("no problem is built for a peak no region can lower")

    with monkeypatch.context() as patched:
        patched.setattr(CHECKPOINT_PASS, "build_problem", never)
        result = checkpoint(copy.deepcopy(chunked), budget="min")
    assert "regions" not in result.stats and "no plan was searched" in result.stats["reason"]
    assert "reached at add" in result.stats["reason"] and "loss_chunk_rows" in result.stats
    # the search it skips finds nothing lower either
    gm = copy.deepcopy(chunked)
    CHECKPOINT_PASS.LossChunks(gm).set(CHECKPOINT_PASS.MIN_CHUNK_ROWS)
    estimate = estimate_train_peak(gm, (ids, targets), watch_saved=True)
    assert estimate.op == "add" and estimate.forward_bytes == 0
    assert estimate_train_peak(gm, (ids, targets)).forward_bytes > 0  # unwatched: counted
    problem, forward = CHECKPOINT_PASS.build_problem(gm, profile=False)
    found = least_memory_plan(problem, lambda plan: CHECKPOINT_PASS._predict(
        gm, forward, plan, TrainingSetup()), max_region_atoms=16)
    assert found is None or found[0] >= estimate.bytes


def test_values_saved_for_backward_are_seen_at_a_peak_they_make():
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(32, 32), nn.Tanh())])
    x = torch.randn(1024, 32)
    estimate = estimate_train_peak(trace(model, x), x)
    # tanh saves its output and each linear its input, the tanh before it: the first five
    # (the sixth is the output), 128 KiB each
    assert estimate.forward_bytes == 5 * 1024 * 32 * 4 and estimate.saved_values_at_peak


def test_idempotent_and_generous_budget_is_a_no_op(model_and_input):
    model, x = model_and_input
    gm = trace(model, x)
    assert checkpoint(gm, budget=0.5).modified
    code = gm.code
    assert checkpoint(gm, budget=0.3).modified is False
    assert gm.code == code
    fresh = trace(model, x)
    assert checkpoint(fresh, budget=1.0).modified is False


def test_state_dict_and_parameters_unchanged(model_and_input):
    model, x = model_and_input
    gm = fxopt.optimize(model, x, memory_budget=0.4)
    assert list(gm.state_dict()) == list(model.state_dict())
    assert [id(p) for p in gm.parameters()] == [id(p) for p in model.parameters()]


def test_frozen_parameters_and_inputs_without_grad(model_and_input):
    model, x = model_and_input
    for p in model[0].parameters():
        p.requires_grad_(False)
    try:
        gm = fxopt.optimize(model, x, memory_budget=0.5)
        out = gm(x)
        out.sum().backward()
        assert model[0].weight.grad is None and model[-1].weight.grad is not None
    finally:
        for p in model.parameters():
            p.requires_grad_(True)
            p.grad = None


def _autocast_step(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Output and parameter gradients (by name) of one bfloat16 autocast training step; grads
    via autograd.grad, BatchNorm statistics put back: model and gm share their tensors."""
    named = dict(module.named_parameters())
    with preserved_state(module), torch.autocast("cpu", dtype=torch.bfloat16):
        module.train()
        torch.manual_seed(3)  # the same dropout masks
        out = module(x)
        grads = torch.autograd.grad(out.float().square().sum(), list(named.values()))
    return out, dict(zip(named, grads))


def test_autocast_bfloat16_matches_original(model_and_input):
    model, x = model_and_input
    gm = fxopt.optimize(model, x, memory_budget=0.5)
    assert sum(isinstance(v, fxopt.runtime.regions.CheckpointedRegion) for v in vars(gm).values())
    expected, expected_grads = _autocast_step(model, x)
    got, grads = _autocast_step(gm, x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)
    assert grads.keys() == expected_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        # float32 gradients of a bfloat16 forward: recomputation replays the same bfloat16 ops
        # (so far bit-identical on CPU); allow bfloat16 rounding (8 bits of mantissa, 2**-8)
        # relative to each gradient's scale, in case a kernel rounds differently on recompute
        scale = expected_grads[name].abs().max().item()
        torch.testing.assert_close(grad, expected_grads[name], rtol=2**-7, atol=2**-7 * scale,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


def _count_calls(monkeypatch, gm):
    """Count entries into a region's checkpointed forward (``_checkpointed``, or
    torch.utils.checkpoint as regions.py calls it), its recomputations in backward
    (``RegionFrame.recompute``) and plain runs of its body (``run``, or ``run_boxed`` with grad
    disabled)."""
    regions = [v for v in vars(gm).values()
               if isinstance(v, fxopt.runtime.regions.CheckpointedRegion)]
    calls = {"checkpoint": 0, "body": 0, "recompute": 0}

    def counting(owner, name, key):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    counting(fxopt.runtime.regions, "checkpoint", "checkpoint")
    counting(fxopt.runtime.regions.CheckpointedRegion, "_checkpointed", "checkpoint")
    counting(fxopt.runtime.regions.CheckpointedRegion, "run", "body")
    counting(fxopt.runtime.regions.CheckpointedRegion, "run_boxed", "body")
    counting(fxopt.runtime.region_frame.RegionFrame, "recompute", "recompute")
    return regions, calls


def test_inference_does_not_checkpoint(model_and_input, monkeypatch):
    model, x = model_and_input
    gm = fxopt.optimize(model, x, memory_budget=0.5)
    regions, calls = _count_calls(monkeypatch, gm)
    assert len(regions) >= 2
    gm.eval()
    model.eval()
    try:
        for inference in (torch.no_grad, torch.inference_mode):
            with inference():
                torch.testing.assert_close(gm(x), model(x))
            # each body called directly, once: no checkpoint, so nothing to recompute
            assert calls == {"checkpoint": 0, "body": len(regions), "recompute": 0}, inference
            calls.update(checkpoint=0, body=0)
    finally:
        model.train()
        gm.train()
    # the control: a training step enters checkpointing once per region and recomputes each one
    # in backward (so the counters above would have seen a checkpointed inference)
    with preserved_state(gm):
        gm(x).sum().backward()
    assert (calls["checkpoint"], calls["recompute"]) == (len(regions), len(regions))


def test_inference_peak_is_the_unoptimized_one(model_and_input):
    """regions.py: with grad disabled the body is just called, on inputs handed over in a list
    it empties, so each is freed at its last use in the body: "inference pays nothing" (before,
    the call held them: conv_stack's inference peak grew from 476,564 to 673,172 bytes). So
    does a deep copy, and a module saved and loaded (its bodies' boxed code generated again)."""
    model, x = model_and_input
    gm = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": 0.5, "profile": False})])
    assert gm.fxopt_report.passes[0].modified
    unoptimized = measure_inference(trace(model, x), x).peak_bytes
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for module in (gm, copy.deepcopy(gm), loaded):
        assert measure_inference(module, x).peak_bytes == unoptimized
    assert gm.fxopt_report.predicted_after.inference_bytes == \
        gm.fxopt_report.predicted_before.inference_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inference_peak_is_the_unoptimized_one_on_cuda():
    """The same on a GPU, read off the caching allocator (cuDNN's workspaces included): the
    regions' inputs are freed inside them, so the optimized module allocates no more."""
    torch.manual_seed(0)
    model, x = conv_stack().cuda(), torch.randn(4, 3, 32, 32, device="cuda")
    gm = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": 0.5, "profile": False})])
    assert gm.fxopt_report.passes[0].modified
    assert measure_inference(gm, x).peak_bytes == measure_inference(trace(model, x), x).peak_bytes


def test_roofline_costs_run_no_compute_and_plan_the_same_every_time(model_and_input, monkeypatch):
    """``profile=False``: one plan on every run (and every DDP rank), nothing timed for real."""
    def no_timing(gm):
        raise AssertionError("profile=False must not time nodes on the device")

    monkeypatch.setattr(fxopt.analysis.costmodel, "forward_seconds", no_timing)
    model, x = model_and_input
    graphs = [fxopt.optimize(model, x, passes=[("checkpoint", {"budget": 0.5, "profile": False})])
              for _ in range(2)]
    assert all(gm.fxopt_report.passes[0].modified for gm in graphs)
    assert graphs[0].code == graphs[1].code
    bodies = [[str(m.body.graph) for _, m in sorted(vars(gm).items())
               if isinstance(m, fxopt.runtime.regions.CheckpointedRegion)] for gm in graphs]
    assert bodies[0] and bodies[0] == bodies[1]


class ThreeConvs(nn.Module):
    """Two conv-BN-ReLU blocks, a conv and a linear head: small, with one clear best plan."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        h = torch.tanh(self.conv3(h))
        return self.head(h.mean((2, 3)))


def test_golden_graph_two_chained_regions():
    """Budget 0.8 of the activations fits only with both blocks recomputed, each as a full region;
    the second region reads the first one's output. Each call site looks up the modules its body
    calls on the root (``@conv1``), so the region holds no state. ``profile=False``: roofline costs (the same
    plan for device rates from 1e8 to 1e12 FLOP/s and 1e8 to 1e11 B/s, checked)."""
    torch.manual_seed(0)
    model, x = ThreeConvs(), torch.randn(2, 3, 16, 16)
    gm, result = check_pass(
        model, (x,), checkpoint, options={"budget": 0.8, "profile": False},
        golden_before="""
            x = input
            conv1 = conv1:Conv2d(x)
            bn1 = bn1:BatchNorm2d(conv1)
            relu = relu(bn1)
            conv2 = conv2:Conv2d(relu)
            bn2 = bn2:BatchNorm2d(conv2)
            relu_1 = relu(bn2)
            conv3 = conv3:Conv2d(relu_1)
            tanh = tanh(conv3)
            mean = .mean(tanh, [2, 3])
            head = head:Linear(mean)
            return head
        """,
        golden_after="""
            x = input
            _fxopt_region_0 = @_fxopt_region_0()
            conv1_1 = @conv1()
            bn1_1 = @bn1()
            region_inputs = region_inputs(x)
            call_region = call_region(_fxopt_region_0, region_inputs, conv1_1, bn1_1)
            _fxopt_region_1 = @_fxopt_region_1()
            conv2_1 = @conv2()
            bn2_1 = @bn2()
            region_inputs_1 = region_inputs(call_region)
            call_region_1 = call_region(_fxopt_region_1, region_inputs_1, conv2_1, bn2_1)
            conv3 = conv3:Conv2d(call_region_1)
            tanh = tanh(conv3)
            mean = .mean(tanh, [2, 3])
            head = head:Linear(mean)
            return head
        """,
    )
    first, second = gm._fxopt_region_0, gm._fxopt_region_1
    assert compact(first.body, gm) == "\n".join([
        "x = input",
        "conv1 = conv1:Conv2d(x)",
        "bn1 = bn1:BatchNorm2d(conv1)",
        "relu = relu(bn1)",
        "return relu"])
    assert compact(second.body, gm) == "\n".join([
        "call_region = input",
        "conv2 = conv2:Conv2d(call_region)",
        "bn2 = bn2:BatchNorm2d(conv2)",
        "relu_1 = relu(bn2)",
        "return relu_1"])
    assert not first.selective and not second.selective
    assert first.targets == ("conv1", "bn1") and second.targets == ("conv2", "bn2")
    # the bodies hold no state of gm: nothing a script swaps on gm can be left behind in them
    assert not any(t.numel() for t in [*first.body.parameters(), *first.body.buffers()])
    stats = result.stats
    assert [(r.region, r.first, r.last, r.nodes, r.mode) for r in stats["regions"]
            ] == [("_fxopt_region_0", "conv1", "relu", 3, "full"),
                  ("_fxopt_region_1", "conv2", "relu_1", 3, "full")]
    assert stats["regions_count"] == 2
    assert stats["predicted_after"] <= stats["budget_bytes"] < stats["predicted_before"]
    assert measure_train_step(gm, (x,)).peak_bytes == stats["predicted_after"]

    # numerics, directly: outputs and every parameter gradient of one training step
    def step(module):
        named = dict(module.named_parameters())
        with preserved_state(module):
            module.train()
            out = module(x)
            grads = torch.autograd.grad(out.square().sum(), list(named.values()))
        return out, dict(zip(named, grads))

    expected, expected_grads = step(model)
    got, grads = step(gm)
    torch.testing.assert_close(got, expected)
    assert grads.keys() == expected_grads.keys() and len(grads) == 12
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=lambda m, n=name: f"{n}: {m}")
