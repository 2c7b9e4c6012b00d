"""fxopt.analysis.prediction_memo: one optimize call predicts each distinct step once, and the
fingerprint tells apart everything a fake run reads."""

import contextlib
import copy

import pytest
import torch
from device_mode import default_device_elsewhere
from torch import fx, nn

import fxopt
import fxopt.analysis.estimate as estimate
import fxopt.analysis.costmodel
import fxopt.api
from fxopt import models_zoo
from fxopt.analysis.prediction_memo import PredictionCounts, predictions_remembered, remembered
from fxopt.core.fingerprint import fingerprint
from fxopt.capture.trace import trace
from fxopt.measure.peaks import measure_train_step
from fxopt.runtime.regions import CheckpointedRegion


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1), nn.Conv2d(8, 8, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


@pytest.fixture
def counted_runs(monkeypatch):
    """The fake runs that really ran, and the predictions asked for."""
    runs, asked = [], []
    predicted, tracked = estimate._predicted, estimate._tracked

    def counting_predicted(*args, **kwargs):
        runs.append(args[2].__name__)
        return predicted(*args, **kwargs)

    def counting_tracked(*args, **kwargs):
        asked.append(args[2].__name__)
        return tracked(*args, **kwargs)

    monkeypatch.setattr(estimate, "_predicted", counting_predicted)
    monkeypatch.setattr(estimate, "_tracked", counting_tracked)
    return runs, asked


@pytest.mark.parametrize("budget", [0.5, "min"])
def test_optimize_predicts_each_distinct_step_once_and_plans_as_without_memory(
        counted_runs, monkeypatch, budget):
    runs, asked = counted_runs
    # node costs from the roofline at this process's rates: the same plan in both calls
    monkeypatch.setattr(fxopt.analysis.costmodel, "forward_seconds", lambda gm: {})
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    with_memory = fxopt.optimize(model, x, memory_budget=budget)
    # the report's last prediction is of the plan the checkpoint pass predicted
    assert len(runs) < len(asked)
    assert with_memory.fxopt_report.predictions == {"run": len(runs),
                                                   "remembered": len(asked) - len(runs)}
    asked_remembering = len(asked)
    runs.clear(), asked.clear()

    @contextlib.contextmanager
    def forgetting():
        yield PredictionCounts()

    monkeypatch.setattr(fxopt.api, "predictions_remembered", forgetting)
    plain = fxopt.optimize(model, x, memory_budget=budget)
    assert len(runs) == len(asked) == asked_remembering
    assert with_memory.code == plain.code
    first, second = with_memory.fxopt_report, plain.fxopt_report
    assert first.predicted_before == second.predicted_before
    assert first.predicted_after == second.predicted_after
    assert [(p.name, p.modified) for p in first.passes] == [
        (p.name, p.modified) for p in second.passes]
    planned = [{k: p.stats.get(k) for k in ("budget_bytes", "predicted_before", "predicted_after")}
               for p in (first.passes[-3], second.passes[-3])]
    assert first.passes[-3].name == "checkpoint" and planned[0] == planned[1]


def test_nothing_is_remembered_outside_an_optimize_call(counted_runs):
    runs, _ = counted_runs
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    gm = trace(model, x)
    for _ in range(2):
        estimate.estimate_train_peak(gm, x)
    assert runs == ["_train", "_train"]
    with predictions_remembered():
        for _ in range(2):
            estimate.estimate_train_peak(gm, x)
    assert runs == ["_train"] * 3


@pytest.fixture(scope="module")
def optimized():
    """A module with checkpointed regions (plain attributes holding graphs and flags)."""
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    gm = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": 0.6, "profile": False})])
    assert any(isinstance(v, CheckpointedRegion) for v in vars(gm).values())
    return gm, x


def _region(gm) -> CheckpointedRegion:
    return next(v for v in vars(gm).values() if isinstance(v, CheckpointedRegion))


def _dropout(gm) -> nn.Dropout:
    return next(m for m in gm.modules() if isinstance(m, nn.Dropout))


def _changes():
    """(what changes, how): each must change the fingerprint of a copy of the module."""
    def edit_code(gm):
        relu = next(n for n in gm.graph.nodes if n.target in (torch.relu, torch.nn.functional.relu)
                    or (n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.ReLU)))
        with gm.graph.inserting_after(relu):
            doubled = gm.graph.call_function(torch.mul, (relu, 2.0))
        relu.replace_all_uses_with(doubled, delete_user_cb=lambda u: u is not doubled)
        gm.recompile()

    def untie(gm):
        conv = next(m for m in gm.modules() if isinstance(m, nn.Conv2d) and m.in_channels == 8)
        conv.weight = nn.Parameter(conv.weight.detach().clone())

    def hook(gm):
        scale = 3.0
        _dropout(gm).register_forward_hook(lambda m, i, o: o * scale)

    return {
        "the generated code": edit_code,
        "a Dropout's p": lambda gm: setattr(_dropout(gm), "p", 0.5),
        "a training flag": lambda gm: _dropout(gm).train(False),
        "a parameter's requires_grad": lambda gm: next(gm.parameters()).requires_grad_(False),
        "a region's flag": lambda gm: setattr(_region(gm), "random", not _region(gm).random),
        "a region's body": lambda gm: setattr(_region(gm), "body", copy.deepcopy(
            _region(gm).recompute or _region(gm).body)),
        "a shared parameter made separate": untie,
        "a forward hook": hook,
        "a member set on its class": lambda gm: setattr(type(gm), "scale", 2.0),
    }


def _copy(gm):
    """A deep copy sharing the parameters and buffers (as the checkpoint pass's candidates do)."""
    memo = {id(t): t for t in [*gm.parameters(), *gm.buffers()]}
    return copy.deepcopy(gm, memo)


def test_a_copy_sharing_the_state_has_the_same_fingerprint(optimized):
    gm, x = optimized
    assert fingerprint(_copy(gm), (x,)) == fingerprint(gm, (x,))
    assert fingerprint(gm, (x,)) != fingerprint(gm, (x[:1],))


@pytest.mark.parametrize("change", list(_changes()))
def test_the_fingerprint_changes_with_what_a_fake_run_reads(optimized, change):
    gm, x = optimized
    tied = _copy(gm)
    if change == "a shared parameter made separate":  # tie two same-shape weights first
        convs = [m for m in tied.modules() if isinstance(m, nn.Conv2d) and m.in_channels == 8]
        convs[1].weight = convs[0].weight
    before = fingerprint(tied, (x,))
    _changes()[change](tied)
    assert fingerprint(tied, (x,)) != before, change


def test_an_object_described_by_its_address_is_kept_alive_while_remembered():
    """A closure is described by its address: were it freed, the next closure could take the
    address and match a module that computes something else."""
    def scaled(scale):
        return lambda t: t * scale

    predicted = []
    with predictions_remembered():
        for scale in (2.0, 3.0):
            module = nn.Identity()
            module.scale = scaled(scale)
            remembered("train", module, (), None, lambda: predicted.append(scale))
            del module
    assert predicted == [2.0, 3.0]


def _one_op(op, name: str) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(op, (x,), name=name))
    return fx.GraphModule(nn.Module(), graph)


def test_graphs_that_differ_only_in_value_names_have_one_fingerprint():
    """The checkpoint pass predicts a plan on a copy of the graph, whose new nodes are named
    apart from those of the module it then edits: the report's prediction of that module is
    the pass's."""
    x = torch.randn(2, 3)
    named, renamed = _one_op(torch.relu, "relu"), _one_op(torch.relu, "renamed")
    assert named.code != renamed.code
    assert fingerprint(named, (x,)) == fingerprint(renamed, (x,))
    assert fingerprint(named, (x,)) != fingerprint(_one_op(torch.sigmoid, "relu"), (x,))


def test_a_remembered_prediction_is_the_measured_peak():
    """On the CPU predictions are exact: the report's prediction of the optimized module, answered
    from memory (the checkpoint pass predicted that plan), equals its measured training peak."""
    model, x = models_zoo.build("unet")
    gm = fxopt.optimize(model, x, memory_budget=0.6)
    assert gm.fxopt_report.predictions["remembered"] >= 1
    assert gm.fxopt_report.predicted_after.train_bytes == measure_train_step(gm, x).peak_bytes


def test_remembered_on_another_default_device_in_bfloat16():
    """What a GPU run meets, on the CPU: tensors made without a device go elsewhere (``meta``),
    the model is in bfloat16. The memo still answers the report's last prediction, which is
    still the measured peak, and nothing of the module leaves the CPU."""
    model, x = small_cnn().to(torch.bfloat16), torch.randn(2, 3, 16, 16, dtype=torch.bfloat16)
    with default_device_elsewhere():
        gm = fxopt.optimize(model, x, memory_budget=0.5)
    report = gm.fxopt_report
    assert report.predictions["remembered"] >= 1 and report.verification.ok
    assert report.predicted_after.train_bytes == measure_train_step(gm, x).peak_bytes
    assert {t.device.type for t in gm.state_dict().values()} == {"cpu"}
