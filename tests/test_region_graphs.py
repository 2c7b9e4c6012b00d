"""Checkpointed regions as graphs built at optimize time (fxopt.rewrite.region_graphs) and run by
saved-tensor hooks (fxopt.runtime.region_frame): golden graphs of the region form, exact
numerics (BatchNorm once, dropout replayed), and what a region no longer does at run time (a
Python callback per ATen op, an RNG stash without random numbers, buffer copies for BatchNorm)."""

import contextlib
import copy
import sys
import weakref

import pytest
import torch
from helpers import assert_same_step, compact, step_record
from torch import fx, nn

import fxopt
import fxopt.runtime.region_frame
import fxopt.runtime.regions
from fxopt.capture.chain import capture as capture_model
from fxopt.capture.trace import trace
from fxopt.core.state import preserved_state
from fxopt.measure.peaks import measure_train_step
from fxopt.planning.solver import FULL, SELECTIVE, CheckpointPlan, Region
from fxopt.runtime.regions import CheckpointedRegion, call_region, region_inputs
from fxopt.verify.equivalence import verify
from fxopt.passes.checkpoint import apply_plan

CALLS = ("call_function", "call_method", "call_module")


class TwoBlocks(nn.Module):
    """conv-BN-ReLU twice, then a head; ``dropout`` after the first block."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn1(self.conv1(x))))
        h = torch.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


def planned(model: nn.Module, x: torch.Tensor, start: int, stop: int, mode: str,
            kept: tuple[int, ...] = (), random: bool = False, capture: str = "fx"):
    """``model`` traced with one region over call nodes [start, stop) in ``mode``."""
    gm = trace(model, x) if capture == "fx" else capture_model(model, (x,), capture="export")
    forward = [n for n in gm.graph.nodes if n.op in CALLS]
    plan = CheckpointPlan([Region(start, stop, mode, 0.0, 0, kept=kept, random=random)])
    apply_plan(gm, forward, plan)
    gm.recompile()
    return gm


def step(module: nn.Module, x: torch.Tensor, seed: int = 0):
    return step_record(module, x, seed=seed)


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return TwoBlocks(), torch.randn(2, 3, 8, 8)


def test_golden_graphs_of_the_region_form(model_and_input):
    model, x = model_and_input
    gm = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    region = gm._fxopt_region_0
    assert [n.name for n in gm.graph.nodes if n.op in CALLS] == [
        "region_inputs", "call_region", "mean", "head"]
    assert region.targets == ("conv1", "bn1", "drop", "conv2", "bn2")
    assert (region.selective, region.random, region.shield) == (True, False, False)
    assert compact(region.body, gm) == "\n".join([
        "x = input",
        "conv1 = conv1:Conv2d(x)",
        "bn1 = bn1:BatchNorm2d(conv1)",
        "relu = relu(bn1)",
        "drop = drop:Identity(relu)",
        "conv2 = conv2:Conv2d(drop)",
        "bn2 = bn2:BatchNorm2d(conv2)",
        "relu_1 = relu(bn2)",
        "return relu_1"])
    assert compact(region.forward, gm) == "\n".join([
        "_fxopt_frame = input",
        "x = input",
        "enter_kept = enter_kept(_fxopt_frame, 0)",
        "conv1 = conv1:Conv2d(x)",
        "leave_kept = leave_kept(_fxopt_frame)",
        "bn1 = bn1:BatchNorm2d(conv1)",
        "relu = relu(bn1)",
        "drop = drop:Identity(relu)",
        "enter_kept_1 = enter_kept(_fxopt_frame, 0, drop)",
        "conv2 = conv2:Conv2d(drop)",
        "leave_kept_1 = leave_kept(_fxopt_frame)",
        "bn2 = bn2:BatchNorm2d(conv2)",
        "relu_1 = relu(bn2)",
        "return [relu_1, [conv1, conv2]]"])
    assert compact(region.recompute, gm) == "\n".join([
        "x = input",
        "conv1 = input",
        "conv2 = input",
        "bn1 = @bn1()",
        "recomputed_batch_norm = recomputed_batch_norm(bn1, conv1)",
        "relu = relu(recomputed_batch_norm)",
        "drop = drop:Identity(relu)",
        "bn2 = @bn2()",
        "recomputed_batch_norm_1 = recomputed_batch_norm(bn2, conv2)",
        "relu_1 = relu(recomputed_batch_norm_1)",
        "return [drop]"])
    assert_same_step(step(gm, x), step(model, x))


def test_a_full_region_recomputes_its_body_with_batch_norm_over_scratch(model_and_input):
    model, x = model_and_input
    gm = planned(model, x, 0, 3, FULL)
    region = gm._fxopt_region_0
    assert region.forward is None and not region.selective
    assert compact(region.recompute, gm) == "\n".join([
        "x = input",
        "conv1 = conv1:Conv2d(x)",
        "bn1 = @bn1()",
        "recomputed_batch_norm = recomputed_batch_norm(bn1, conv1)",
        "relu = relu(recomputed_batch_norm)",
        "return []"])
    assert_same_step(step(gm, x), step(model, x))
    # a region without BatchNorm recomputes its body as it is
    no_bn = planned(model, x, 2, 4, FULL)
    assert no_bn._fxopt_region_0.recompute is no_bn._fxopt_region_0.body


def test_aten_graphs_recompute_batch_norm_over_scratch_and_skip_the_counter(model_and_input):
    """torch.export's graphs: ``aten.batch_norm`` gets ``empty_like`` running statistics and the
    ``add_`` of ``num_batches_tracked`` is left out of the recomputation."""
    model, x = model_and_input
    gm = planned(model, x, 0, 4, FULL, capture="export")
    region = next(v for v in vars(gm).values() if isinstance(v, CheckpointedRegion))
    body = [n.target for n in region.body.graph.nodes if n.op == "call_function"]
    recompute = [n.target for n in region.recompute.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert aten.add_.Tensor in body and aten.add_.Tensor not in recompute
    assert recompute.count(torch.empty_like) == 2 and not region.shield
    assert_same_step(step(gm, x), step(model, x))


def _profiled_calls(module: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Python-level calls of one training step, by function name."""
    counts: dict[str, int] = {}

    def profiler(frame, event, arg):
        if event == "call":
            counts[frame.f_code.co_name] = counts.get(frame.f_code.co_name, 0) + 1
        elif event == "c_call":
            name = getattr(arg, "__name__", "")
            counts[name] = counts.get(name, 0) + 1

    with preserved_state(module):
        module.train()
        sys.setprofile(profiler)
        try:
            module(x).sum().backward()
        finally:
            sys.setprofile(None)
    return counts


class _CountConvolutions(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten.convolution
        return func(*args, **(kwargs or {}))


def test_a_selective_region_runs_no_dispatch_mode_and_recomputes_no_convolution(
        model_and_input):
    model, x = model_and_input
    gm = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    calls = _profiled_calls(gm, x)
    assert calls.get("__torch_dispatch__", 0) == 0
    assert calls.get("get_rng_state", 0) == calls.get("set_rng_state", 0) == 0
    assert calls.get("buffers_as_before", 0) == calls.get("buffers_shielded", 0) == 0
    assert calls.get("recompute") == 1
    counter = _CountConvolutions()
    with preserved_state(gm), counter:
        gm.train()
        gm(x).sum().backward()
    assert counter.count == 2  # the forward's two; a full region recomputes them (below)
    full = planned(model, x, 0, 7, FULL)
    counter = _CountConvolutions()
    with preserved_state(full), counter:
        full.train()
        full(x).sum().backward()
    assert counter.count == 4


def test_rng_state_is_stashed_only_for_regions_that_draw_random_numbers():
    """The plan says which regions draw random numbers: only those stash and replay the RNG, and
    dropout's masks are replayed exactly (the gradients equal the model's under one seed)."""
    torch.manual_seed(0)
    model, x = TwoBlocks(dropout=0.3), torch.randn(2, 3, 8, 8)
    gm = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": "min", "profile": False})])
    regions = [v for _, v in sorted(vars(gm).items()) if isinstance(v, CheckpointedRegion)]
    assert regions and gm.fxopt_report.verification.ok
    random = [r for r in regions if any(n.target == "drop" for n in r.body.graph.nodes)]
    assert [r.random for r in regions] == [r in random for r in regions] and random
    calls = _profiled_calls(gm, x)
    # per random region: read in its forward, and around its recomputation: read, replayed, put back
    assert calls.get("get_rng_state", 0) == 2 * len(random)
    assert calls.get("set_rng_state", 0) == 2 * len(random)
    assert_same_step(step(gm, x, seed=7), step(model, x, seed=7))


class _Counter(nn.Module):
    """A leaf that writes a buffer of its own: its region recomputes over a copy of it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x * 2


class WithCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.counter, self.head = nn.Conv2d(3, 8, 3, padding=1), _Counter(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.counter(self.conv(x))).mean((2, 3)))


def test_buffers_are_copied_only_for_regions_writing_buffers_batch_norm_is_not_one(
        model_and_input, monkeypatch):
    model, x = model_and_input
    gm = planned(model, x, 0, 7, FULL)
    assert not gm._fxopt_region_0.shield

    def refuse(reads):
        raise AssertionError("BatchNorm's region copied its buffers")

    monkeypatch.setattr(fxopt.runtime.regions, "buffers_as_before", refuse)
    monkeypatch.setattr(fxopt.runtime.regions, "buffers_shielded", refuse)
    assert_same_step(step(gm, x), step(model, x))  # running statistics updated once
    monkeypatch.undo()
    torch.manual_seed(0)
    other, x = WithCounter(), torch.randn(2, 3, 8, 8)
    traced = trace(other, x, leaf_modules=("counter",))
    forward = [n for n in traced.graph.nodes if n.op in CALLS]
    apply_plan(traced, forward, CheckpointPlan([Region(0, 3, FULL, 0.0, 0, random=False)]))
    traced.recompile()
    assert traced._fxopt_region_0.shield
    before = int(other.counter.calls)
    assert_same_step(step(traced, x), step(other, x))
    with preserved_state(traced):
        traced(x).sum().backward()
        assert int(other.counter.calls) == before + 1  # written by the forward only


class SpectralNormed(nn.Module):
    """Spectral norm's power iteration updates ``_u`` and ``_v`` in forward, and the weight it
    computes reads them."""

    def __init__(self):
        super().__init__()
        norm = torch.nn.utils.parametrizations.spectral_norm
        self.c1 = norm(nn.Conv1d(4, 16, 3, padding=1))
        self.c2 = norm(nn.Conv1d(16, 16, 3, padding=1))
        self.c3 = nn.Conv1d(16, 4, 1)

    def forward(self, x):
        return self.c3(torch.tanh(self.c2(torch.tanh(self.c1(x))))).square().mean()


def test_a_buffer_the_forward_updates_and_reads_is_recomputed_as_the_forward_read_it():
    """A region whose modules write buffers recomputes over copies of them. The copies were made
    when backward recomputed, after the forward's power iteration had moved ``_u`` and ``_v``:
    the recomputed weight was another one, a gradient 0.26% off in float64, and ``optimize`` at
    "min" failed its own verification. The copies are now made before the forward: three SGD
    steps equal the model's, parameters and buffers."""
    torch.manual_seed(0)
    model, x = SpectralNormed().double(), torch.randn(2, 4, 32, dtype=torch.float64)
    slim = fxopt.optimize(model, (x,), capture="fx", memory_budget="min")
    regions = [v for v in vars(slim).values() if isinstance(v, CheckpointedRegion)]
    assert regions and any(r.shield for r in regions)
    reference = copy.deepcopy(model)
    trained = copy.deepcopy(slim)
    for module in (reference, trained):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        for _ in range(3):
            optimizer.zero_grad()
            module(x).backward()
            optimizer.step()
    for (name, a), b in zip(reference.state_dict().items(), trained.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14, msg=name)


def test_backward_twice_full_region_recomputes_selective_region_refuses(model_and_input):
    model, x = model_and_input
    full = planned(model, x, 0, 7, FULL)
    with preserved_state(full):
        full.train()
        loss = full(x).square().sum()
        first = torch.autograd.grad(loss, list(full.parameters()), retain_graph=True)
        second = torch.autograd.grad(loss, list(full.parameters()))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)
    selective = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    with preserved_state(selective):
        selective.train()
        loss = selective(x).square().sum()
        torch.autograd.grad(loss, list(selective.parameters()), retain_graph=True)
        with pytest.raises(fxopt.ConfigError, match="selective checkpointed region .* second "
                                                    "time"):
            torch.autograd.grad(loss, list(selective.parameters()))


def test_torch_jit_trace_records_a_regions_plain_forward(model_and_input):
    """``torch.jit.trace`` with grad enabled (its default) ran a region's training forward,
    whose saved-tensor bookkeeping made two traces of one call differ: the trace's own check
    failed ("Graphs differed across invocations"), where the model traces. A region under the
    tracer runs its plain body (a TorchScript graph has no checkpointing), and the traced
    module computes the model's outputs."""
    model, x = model_and_input
    selective = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    for module in (model, selective):
        module.eval()
    traced = torch.jit.trace(selective, x)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x))


def test_a_gradient_penalty_backs_through_a_selective_region_as_through_the_model(
        model_and_input):
    """A gradient penalty (WGAN-GP, R1) differentiates a gradient: ``autograd.grad(...,
    create_graph=True)``, then a backward of the gradient's norm, which goes through the
    region's saved tensors again. A selective region released its kept outputs after the first
    and raised "a second time (retain_graph=True)" where the model trains; one whose backward
    builds a graph now keeps them, and the parameters' gradients are the model's."""
    model, x = model_and_input
    selective = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    grads = []
    for module in (model, selective):
        with preserved_state(module):
            module.train()
            image = x.clone().requires_grad_()
            (slope,) = torch.autograd.grad(module(image).square().sum(), image,
                                           create_graph=True)
            slope.square().sum().backward()
            grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


class ConvOutToo(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return torch.relu(self.bn(y)), y


def test_a_kept_output_changed_in_place_after_the_region_is_caught():
    """The region keeps conv's output and returns it; changed in place afterwards, the
    recomputation would read the changed value: autograd's own version check refuses."""
    torch.manual_seed(0)
    model, x = ConvOutToo(), torch.randn(2, 3, 6, 6)
    gm = planned(model, x, 0, 3, SELECTIVE, kept=(0,))
    with preserved_state(gm):
        gm.train()
        out, y = gm(x)
        loss = out.sum()
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_frames_are_freed_with_or_without_backward(model_and_input, monkeypatch):
    model, x = model_and_input
    frames = []
    real = fxopt.runtime.region_frame.RegionFrame.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        frames.append(weakref.ref(self))

    monkeypatch.setattr(fxopt.runtime.region_frame.RegionFrame, "__init__", recording)
    for gm in (planned(model, x, 0, 7, FULL), planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))):
        with preserved_state(gm):
            gm.train()
            out = gm(x)
            del out  # no backward: nothing keeps the frame (no reference cycle through it)
            gm(x).sum().backward()
    assert len(frames) == 4 and all(f() is None for f in frames)


def test_saved_tensor_hooks_around_the_model_see_what_a_region_keeps(model_and_input):
    model, x = model_and_input
    gm = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    expected = step(model, x)
    with torch.autograd.graph.save_on_cpu():
        got = step(gm, x)
    assert_same_step(got, expected)


def test_selective_regions_stay_selective_under_autocast(model_and_input):
    """Autocast is replayed in the recomputation; convolutions are kept, not recomputed."""
    model, x = model_and_input
    gm = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    counter = _CountConvolutions()
    with preserved_state(gm), torch.autocast("cpu", dtype=torch.bfloat16), counter:
        gm.train()
        out = gm(x)
    with preserved_state(gm):
        out.float().square().sum().backward()
    assert counter.count == 2
    for module in (model, gm):
        module.zero_grad(set_to_none=True)
    with preserved_state(model, gm), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        expected = model(x)
        torch.manual_seed(0)
        got = gm(x)
    torch.testing.assert_close(got, expected)


class Mlp3d(nn.Module):
    """Linear layers on (batch, tokens, features): what they save is a view of their input."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x))))


def test_a_kept_node_saving_a_view_of_its_input_gets_that_view_rebuilt():
    torch.manual_seed(0)
    model, x = Mlp3d(), torch.randn(2, 5, 8, requires_grad=True)
    gm = planned(model, x, 0, 4, SELECTIVE, kept=(0, 3))
    frame_slots = []
    real = fxopt.runtime.region_frame.RegionFrame.recompute

    def recording(frame):
        real(frame)
        frame_slots.extend(slot.view for slot in frame.arg_slots)

    fxopt.runtime.region_frame.RegionFrame.recompute = recording
    try:
        got = step(gm, x)
    finally:
        fxopt.runtime.region_frame.RegionFrame.recompute = real
    assert any(view is not None for view in frame_slots)  # down saved gelu.view(-1, 32)
    assert_same_step(got, step(model, x))


def test_planned_regions_verify_and_their_peaks_are_predicted_exactly():
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 12, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(12), nn.ReLU(), nn.Dropout(0.1), nn.Conv2d(12, 12, 3, padding=1)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
    x = torch.randn(4, 3, 24, 24)
    seen = set()
    for budget in (0.8, 0.5, "min"):
        gm = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": budget,
                                                              "profile": False})])
        stats = gm.fxopt_report.passes[0].stats
        regions = [v for v in vars(gm).values() if isinstance(v, CheckpointedRegion)]
        seen |= {r.selective for r in regions}
        assert gm.fxopt_report.verification.ok
        assert measure_train_step(gm, x).peak_bytes == stats["predicted_after"]
        clone = copy.deepcopy(gm)  # regions copy as code
        assert_same_step(step(clone, x), step(model, x))
    assert seen == {True, False}


def test_verification_catches_a_recompute_graph_that_updates_batch_norm_again(
        model_and_input, monkeypatch):
    model, x = model_and_input
    gm = planned(model, x, 0, 7, SELECTIVE, kept=(0, 4))
    assert verify(model, gm, x).ok
    monkeypatch.setattr(fxopt.runtime.regions, "_PLAIN_BATCH_NORMS", ())
    report = verify(model, gm, x)
    assert not report.ok and {m.kind for m in report.mismatches} == {"buffer"}


class SharedNorm(nn.Module):
    """One BatchNorm called before a region and inside it."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(self.bn(x))))


def test_a_batch_norm_called_inside_and_outside_a_region_keeps_what_backward_saved():
    """The call outside saves ``running_mean`` for backward; the recomputation inside the region
    must not write it (autograd would raise 'modified by an inplace operation'), and the
    statistics must be updated twice per step, as the model updates them."""
    torch.manual_seed(0)
    model, x = SharedNorm(), torch.randn(8, 4)
    gm = planned(model, x, 1, 4, FULL)
    assert [n.target for n in gm._fxopt_region_0.body.graph.nodes if n.op == "call_module"] == [
        "lin", "bn"]
    assert_same_step(step(gm, x), step(model, x))


def test_the_planner_prices_a_region_as_the_device_runs_it(model_and_input):
    """A region's own cost is measured once on the planning device (a call, and each tensor its
    recomputed nodes save); ``profile=False`` takes fixed figures, so it plans alike everywhere."""
    from fxopt.analysis.costmodel import NOMINAL_REGION_COSTS, region_costs
    from fxopt.analysis.node_timing import region_overhead
    from fxopt.planning.checkpoint_problem import build_problem

    per_call, per_saved = region_overhead("cpu")
    assert 0 < per_call < 1e-2 and 0 <= per_saved < 1e-3
    model, x = model_and_input
    gm = trace(model, x)
    assert region_costs(gm, profile=False) == NOMINAL_REGION_COSTS["cpu"]
    assert region_costs(gm) == (per_call, per_saved)  # measured once per process
    problem, _ = build_problem(gm, profile=False)
    assert (problem.region_seconds, problem.saved_seconds) == NOMINAL_REGION_COSTS["cpu"]


def test_a_boxed_body_takes_its_inputs_out_of_the_list_whatever_their_names():
    """Without grad a boxed region runs code generated from its body's graph that unpacks the
    list and empties it; inputs named like the list's usual names still unpack."""
    graph = fx.Graph()
    first, second = graph.placeholder("inputs"), graph.placeholder("args_list")
    graph.output(graph.call_function(torch.mul, (first, second)))
    region = CheckpointedRegion(fx.GraphModule(nn.Module(), graph), selective=False, targets=(),
                                boxed=True)
    a, b = torch.randn(3), torch.randn(3)
    box = region_inputs(a, b)
    with torch.no_grad():
        out = call_region(region, box)
    assert box == [] and torch.equal(out, a * b)
    box = region_inputs(a.requires_grad_(), b)  # a training forward takes them out too
    call_region(region, box).sum().backward()
    assert box == [] and torch.equal(a.grad, b)
