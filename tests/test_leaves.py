"""Opaque leaves are measured, not guessed (issue 25).

A leaf that cannot run on fake tensors (``if x.mean() > 0``, ``torch.where`` dispatch) is run for
real on the example inputs at capture and replays that run on fakes, so predictions count it op by
op: predicted peaks equal measured ones to the byte on CPU, budgets plan around and through it,
and recomputing it is safe (RNG replayed; a leaf that writes its input is not recomputed apart
from that input's producer).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import fxopt
from fxopt.analysis.leaf_runs import leaf_lines, record_leaf_memory
from fxopt.analysis.writes import overwritten_inputs
from fxopt.graph.leaf_tape import leaf_records
from fxopt.capture.trace import trace
from fxopt.core.errors import InputError
from fxopt.planning.checkpoint_problem import build_problem
from fxopt.runtime.regions import CheckpointedRegion
from fxopt.models_zoo.leaves import MOE_LEAVES, branchy_cnn, moe_transformer

MODELS = {"branchy_cnn": (branchy_cnn, (), ("branch",)),
          "moe_transformer": (moe_transformer, MOE_LEAVES, MOE_LEAVES)}


def built(name):
    factory, leaf_modules, _ = MODELS[name]
    model, inputs = factory()
    return model, inputs, leaf_modules


def regions_of(module):
    return [value for m in module.modules() for value in vars(m).values()
            if isinstance(value, CheckpointedRegion)]


def leaf_calls_in(region, leaf_paths):
    return [n for n in region.body.graph.find_nodes(op="call_module")
            if any(n.target == p or n.target.endswith("." + p) or p.endswith("." + n.target)
                   for p in leaf_paths)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def traced(request):
    model, inputs, leaf_modules = built(request.param)
    return request.param, model, inputs, trace(model, inputs, leaf_modules=leaf_modules)


def test_the_models_cannot_run_on_fake_tensors_as_they_are(traced):
    name, model, inputs, _ = traced
    with pytest.raises(InputError, match="cannot run on fake tensors"):
        fxopt.estimate_peak(model, inputs)


def test_each_leaf_is_recorded_on_a_real_run_in_both_modes(traced):
    name, _, _, gm = traced
    records = leaf_records(gm)
    assert sorted(r.path for r in records) == sorted(MODELS[name][2])
    for record in records:
        assert record.replays
        assert sorted(call.key[0] for call in record.calls) == [False, True]  # eval, train
        assert not record.writes_inputs
    nodes = [n for n in gm.graph.find_nodes(op="call_module") if "fxopt_leaf" in n.meta]
    assert {n.meta["fxopt_meta_source"] for n in nodes} == {"real"}


def test_predicted_peaks_equal_measured_to_the_byte(traced):
    _, model, inputs, gm = traced
    predicted = fxopt.estimate_peak(gm, inputs)
    measured = fxopt.measure(gm, inputs)
    assert predicted.train_bytes == measured.train.peak_bytes
    assert predicted.inference_bytes == measured.inference.peak_bytes
    # the user's model steps the same (its eager inference keeps a Sequential's argument alive
    # through the call, which the traced graph frees: not compared)
    assert fxopt.measure_train_step(model, inputs).peak_bytes == measured.train.peak_bytes


def test_figures_measured_inside_each_leaf_equal_its_fake_replay(traced):
    _, _, inputs, gm = traced
    records = record_leaf_memory(gm, inputs)
    for record in records:
        memory = record.memory
        assert memory.exact and memory.replayed == memory.measured
        assert memory.measured.peak_bytes >= memory.measured.output_bytes > 0
        assert memory.measured.saved_bytes > 0
    lines = leaf_lines(gm)
    assert len(lines) == len(records)
    assert all("measured on a real run" in line and "same figures" in line for line in lines)


def test_a_leaf_whose_replay_fails_stands_in_with_its_measured_figures():
    model, inputs, leaf_modules = built("branchy_cnn")
    gm = trace(model, inputs, leaf_modules=leaf_modules)
    record_leaf_memory(gm, inputs)
    (record,) = leaf_records(gm)
    measured = fxopt.measure_train_step(model, inputs).peak_bytes
    exact = fxopt.estimate_peak(gm, inputs).train_bytes
    record.replays = False  # as when an op runs differently on fakes: the stand-in is used
    stood_in = fxopt.estimate_peak(gm, inputs).train_bytes
    memory = record.memory
    record.memory = None  # no figures: outputs and gradients only, the old guess
    guessed = fxopt.estimate_peak(gm, inputs).train_bytes
    assert exact == measured
    assert guessed < stood_in <= measured + memory.measured.peak_bytes
    assert abs(stood_in - measured) < abs(guessed - measured)


def test_other_input_sizes_are_refused_with_a_reason(traced):
    _, _, inputs, gm = traced
    bigger = tuple(torch.cat([t, t]) for t in inputs)
    with pytest.raises(InputError, match="run for real only on the example inputs' sizes"):
        fxopt.estimate_peak(gm, bigger)


@pytest.mark.parametrize("budget", ["min", 0.6])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_budgets_plan_through_leaves_verify_and_predict_to_the_byte(name, budget):
    model, inputs, leaf_modules = built(name)
    gm = fxopt.optimize(model, inputs, memory_budget=budget, leaf_modules=leaf_modules)
    report = gm.fxopt_report  # optimize verified it: it raises EquivalenceError otherwise
    assert report.verification is not None
    assert report.predicted_after.train_bytes < report.predicted_before.train_bytes
    assert report.predicted_after.train_bytes == fxopt.measure_train_step(gm, inputs).peak_bytes
    assert report.predicted_before.train_bytes == fxopt.measure_train_step(model, inputs).peak_bytes
    regions = regions_of(gm)
    assert any(leaf_calls_in(r, MODELS[name][2]) for r in regions)  # a leaf is recomputed
    assert "measured on a real run on the example inputs" in str(report)


# ---------------------------------------------------------------- recomputing a leaf is safe


class RandomBranch(nn.Module):
    """Draws a number to pick a branch, and a dropout mask: recomputation must replay both."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)

    def forward(self, x):
        if torch.rand(()) < torch.sigmoid(x.mean()):  # reads x: symbolic tracing keeps a leaf
            return F.dropout(torch.tanh(self.a(x)), 0.5, training=self.training)
        return torch.relu(self.b(x)) * torch.rand_like(x)


class WithRandomLeaf(nn.Module):
    """The value-branching CNN's shape (``models_zoo.leaves.BranchyCNN``), its leaf random."""

    def __init__(self):
        super().__init__()
        self.stem, self.leaf = nn.Conv2d(3, 16, 3, padding=1), RandomBranch()
        self.stages = nn.Sequential(*(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
                                      for _ in range(4)))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.stages(self.leaf(torch.relu(self.stem(x)))).mean((2, 3)))


def _grads(model, x, seed, run):
    model.zero_grad()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        run(model, x).sum().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(first, second):
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(first, second, strict=True))


def test_a_leaf_checkpointed_whole_replays_its_random_draws():
    torch.manual_seed(0)
    model, x = WithRandomLeaf(), torch.randn(4, 3, 32, 32)
    gm = fxopt.optimize(model, x, memory_budget="min", passes=["checkpoint"], capture="fx")
    assert any(leaf_calls_in(r, ("leaf",)) for r in regions_of(gm))
    for seed in range(4):  # both branches, each recomputed in backward
        eager = _grads(model, x, seed, lambda m, v: m(v))
        assert _same(eager, _grads(gm, x, seed, lambda m, v: m(v)))
    # without replaying the RNG, recomputation takes other draws: another branch (which
    # torch.utils.checkpoint notices) or another mask (wrong gradients)
    def unreplayed(m, v):
        v = torch_checkpoint(m.leaf, torch.relu(m.stem(v)), use_reentrant=False,
                             preserve_rng_state=False)
        return m.head(m.stages(v).mean((2, 3)))

    def wrong(seed):
        try:
            return not _same(_grads(model, x, seed, lambda m, v: m(v)),
                             _grads(model, x, seed, unreplayed))
        except RuntimeError:
            return True

    assert all(wrong(seed) for seed in range(4))


class ScalesInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        if x.mean() > -1e9:
            x.mul_(2)
        return torch.tanh(self.lin(x))


class WithInPlaceLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.leaf = nn.Linear(64, 256), ScalesInPlace()
        self.b, self.c, self.d = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        x = torch.sigmoid(self.b(self.leaf(self.a(x))))
        return self.d(torch.sigmoid(self.c(x)))


def test_a_leaf_that_writes_its_input_is_recomputed_only_with_that_input_s_producer():
    torch.manual_seed(0)
    model, x = WithInPlaceLeaf(), torch.randn(512, 64)
    gm = trace(model, x)
    leaf = next(n for n in gm.graph.nodes if n.target == "leaf")
    (record,) = leaf_records(gm)
    assert record.writes_inputs
    assert [n.target for n in overwritten_inputs(gm, leaf)] == ["a"]
    problem, forward = build_problem(gm, profile=False)
    info = problem.nodes[forward.index(leaf)]
    assert info.mutates == "a"  # a region may hold the leaf only together with a
    optimized = fxopt.optimize(model, x, memory_budget="min", passes=["checkpoint"], capture="fx")
    assert any(leaf_calls_in(r, ("leaf",)) for r in regions_of(optimized))  # it is recomputed,
    for region in regions_of(optimized):  # with the producer of what it overwrites
        for call in leaf_calls_in(region, ("leaf",)):
            assert call.args[0].op != "placeholder"  # its input is made inside the region
    # recomputing the leaf apart from its input's producer breaks: the input it recomputes from
    # is the one it already overwrote
    eager = _grads(model, x, 0, lambda m, v: m(v))
    def alone(m, v):
        v = torch.sigmoid(m.b(torch_checkpoint(m.leaf, m.a(v), use_reentrant=False)))
        return m.d(torch.sigmoid(m.c(v)))

    try:
        wrong = not _same(eager, _grads(model, x, 0, alone))
    except RuntimeError:  # autograd notices the overwritten input
        wrong = True
    assert wrong


# ---------------------------------------------------------------- the CLI does what the API does


def run_cli(argv, capsys):
    from fxopt.cli import commands as cli

    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_optimizes_the_branching_cnn_and_predicts_its_peaks(capsys):
    code, out, err = run_cli(["optimize", "fxopt.models_zoo.leaves:branchy_cnn", "--repeats", "1",
                              "--threads", "1"], capsys)
    assert code == 0, err
    assert "verification: equivalent" in out
    assert "branch (ValueBranch), measured on a real run on the example inputs" in out
    rows = {line[:34].strip(): line[34:].split() for line in out.splitlines()
            if line.strip().startswith("train peak,")}
    assert rows["train peak, measured"][:4] == rows["train peak, predicted"][:4]  # before, after


def test_cli_leaf_modules_and_a_budget_on_the_moe_transformer(tmp_path, capsys):
    paths = ",".join(MOE_LEAVES)
    code, out, err = run_cli(["optimize", "fxopt.models_zoo.leaves:moe_transformer",
                              "--leaf-modules",
                              paths, "--memory-budget", "min", "--repeats", "1", "--threads", "1"],
                             capsys)
    assert code == 0, err
    assert "checkpoint             changed" in out and "verification: equivalent" in out
    for path in MOE_LEAVES:
        assert f"{path} (TopOneMoE), measured on a real run" in out
    rows = {line[:34].strip(): line[34:].split() for line in out.splitlines()
            if line.strip().startswith("train peak,")}
    assert rows["train peak, measured"][:4] == rows["train peak, predicted"][:4]
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        run_cli(["optimize", "fxopt.models_zoo.leaves:moe_transformer", "--leaf-modules",
                 "blocks.0.moe;rm"], capsys)
    assert exit_.value.code == 2 and "expected module paths" in capsys.readouterr().err


class _Encoder(nn.Module):
    """A block the user keeps opaque (``leaf_modules``) whose own forward calls its layers."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.relu(self.inner(x)))


class _Leafy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.enc, self.head = nn.Linear(8, 8), _Encoder(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.enc(torch.relu(self.stem(x))))


def test_a_layer_sharded_inside_a_leaf_the_graph_calls_trains_as_on_the_model(tmp_path):
    """FSDP2 on a layer inside an opaque leaf: the graph calls the leaf, whose own forward calls
    the layer, so FSDP2's hooks gather its parameters as on the user's model. The call guard
    refused it as a layer the graph never calls; it now trains bit for bit like the model
    sharded alike (one process, gloo), while the encoder sharded where the root's graph runs it
    inline (traced through, its layers called one by one) is refused."""
    import datetime

    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model, x = _Leafy(), torch.randn(4, 8)
    slim = fxopt.optimize(model, x, capture="fx", leaf_modules=("enc",), verify=False,
                          predict_memory=False)
    inline = fxopt.optimize(model, x, capture="fx", verify=False, predict_memory=False)

    def step(module):
        out = module(x)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                              for n, p in module.named_parameters()}

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        plain = copy.deepcopy(model)
        for module in (plain, slim):
            fully_shard(module.enc.inner)
            fully_shard(module)
        expected, got = step(plain), step(slim)
        fully_shard(inline.enc)  # the root's graph runs enc inline, calling its layers
        with pytest.raises(fxopt.ConfigError, match="never calls it") as caught:
            inline(x)
        assert caught.value.where == "enc"
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert list(got[1]) == list(expected[1])
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=name)
