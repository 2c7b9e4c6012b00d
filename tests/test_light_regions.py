"""Light checkpointed regions: only concatenations, pointwise ops and views are recomputed, every
other output they read is kept (DenseNet's concatenation before each BatchNorm, which the
memory-efficient DenseNet recomputes by hand). Golden graphs of the form, exact numerics, the
memory they free measured and predicted, and the plans where a light region would read what the
forward no longer holds, refused."""

import copy
import dataclasses

import pytest
import torch
from helpers import assert_same_step, compact, step_record
from torch import nn

from fxopt.capture.trace import trace
from fxopt.analysis.estimate import estimate_train_peak
from fxopt.measure.peaks import measure_train_step
from fxopt.passes.checkpoint import apply_plan
from fxopt.planning.checkpoint_problem import build_problem
from fxopt.planning.solver import (
    FULL,
    LIGHT,
    SELECTIVE,
    CheckpointPlan,
    NodeInfo,
    Region,
    _light_allowed,
    kept_names,
    make_region,
    plan_checkpoints,
)
from fxopt.runtime.regions import CheckpointedRegion, is_light

CALLS = ("call_function", "call_method", "call_module")


class DenseLayers(nn.Module):
    """Two DenseNet layers: each concatenates the features so far, then BatchNorm, an in-place
    ReLU and a convolution."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv0 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1, self.relu1 = nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2, self.relu2 = nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(2 * width, width, 3, padding=1)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        f0 = self.conv0(x)
        f1 = self.conv1(self.relu1(self.bn1(f0)))
        h = self.relu2(self.bn2(torch.cat([f0, f1], 1)))
        return self.head(self.conv2(h).mean((2, 3)))


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return DenseLayers(), torch.randn(2, 3, 16, 16)


def light_planned(model: nn.Module, x: torch.Tensor, start: int, stop: int):
    gm = trace(model, x)
    forward = [n for n in gm.graph.nodes if n.op in CALLS]
    nodes = forward[start:stop]
    kept = tuple(i for i, n in enumerate(nodes, start=start) if n.target is not torch.cat)
    plan = CheckpointPlan([Region(start, stop, LIGHT, 0.0, 0, kept=kept, random=False)])
    apply_plan(gm, forward, plan)
    gm.recompile()
    return gm


def test_golden_graphs_of_a_light_region(model_and_input):
    model, x = model_and_input
    gm = light_planned(model, x, 3, 7)  # conv1, cat, bn2, relu2
    region = gm._fxopt_region_0
    assert (region.light, region.selective, region.random, region.shield) == (
        True, True, False, False)
    assert repr(region) == "CheckpointedRegion(light, 7 nodes)"
    assert compact(region.forward, gm) == "\n".join([
        "_fxopt_frame = input",
        "relu1 = input",
        "conv0 = input",
        "enter_kept = enter_kept(_fxopt_frame, 0)",
        "conv1 = conv1:Conv2d(relu1)",
        "leave_kept = leave_kept(_fxopt_frame)",
        "cat = cat([conv0, conv1], 1)",
        "enter_kept_1 = enter_kept(_fxopt_frame, 0, cat)",
        "bn2 = bn2:BatchNorm2d(cat)",
        "leave_kept_1 = leave_kept(_fxopt_frame)",
        "enter_kept_2 = enter_kept(_fxopt_frame, 1)",
        "relu2 = relu2:ReLU(inplace)(bn2)",
        "leave_kept_2 = leave_kept(_fxopt_frame)",
        "return [relu2, [conv1]]"])
    # only the concatenation runs again, from the kept convolution and the region's input
    assert compact(region.recompute, gm) == "\n".join([
        "relu1 = input",
        "conv0 = input",
        "conv1 = input",
        "cat = cat([conv0, conv1], 1)",
        "return [cat]"])
    assert_same_step(step_record(gm, x), step_record(model, x))


class DenseBlock(nn.Module):
    """A dense block of ``layers`` layers: concatenation, BatchNorm, in-place ReLU, convolution."""

    def __init__(self, layers: int = 4, growth: int = 8):
        super().__init__()
        self.conv0 = nn.Conv2d(3, growth, 3, padding=1)
        self.norms = nn.ModuleList(nn.BatchNorm2d(growth * (i + 1)) for i in range(layers))
        self.relus = nn.ModuleList(nn.ReLU(inplace=True) for _ in range(layers))
        self.convs = nn.ModuleList(nn.Conv2d(growth * (i + 1), growth, 3, padding=1)
                                   for i in range(layers))
        self.head = nn.Linear(growth * (layers + 1), 4)

    def forward(self, x):
        features = [self.conv0(x)]
        for norm, relu, conv in zip(self.norms, self.relus, self.convs):
            features.append(conv(relu(norm(torch.cat(features, 1)))))
        return self.head(torch.cat(features, 1).mean((2, 3)))


class DenseLayersWithDropout(DenseLayers):
    """DenseLayers with dropout on the second layer's features before they are concatenated."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        f0 = self.conv0(x)
        f1 = self.drop(self.conv1(self.relu1(self.bn1(f0))))
        h = self.relu2(self.bn2(torch.cat([f0, f1], 1)))
        return self.head(self.conv2(h).mean((2, 3)))


def test_a_light_region_keeps_dropout_and_replays_no_random_numbers(monkeypatch):
    """Dropout is no light op: a light region keeps its output, so its recomputation draws no
    random numbers and the region stashes no RNG state; the masks are the forward's."""
    torch.manual_seed(0)
    model, x = DenseLayersWithDropout(), torch.randn(2, 3, 16, 16)
    gm = trace(model, x)
    forward = [n for n in gm.graph.nodes if n.op in CALLS]
    assert [n.name for n in forward[3:8]] == ["conv1", "drop", "cat", "bn2", "relu2"]
    problem, _ = build_problem(gm, profile=False)
    region = make_region(problem, 3, 8, LIGHT, 0.0, 0, 0)
    assert region.kept == (3, 4, 6, 7) and not region.random
    apply_plan(gm, forward, CheckpointPlan([region]))
    gm.recompile()
    reads = []
    monkeypatch.setattr(torch, "get_rng_state",
                        lambda real=torch.get_rng_state: reads.append(1) or real())
    expected = step_record(model, x, seed=7)
    by_the_model = len(reads)  # what the step itself reads (seeding, state kept around it)
    assert_same_step(step_record(gm, x, seed=7), expected)
    assert len(reads) == 2 * by_the_model  # the region read none


def test_where_batch_norm_costs_more_than_concatenating_only_the_concatenations_are_recomputed():
    """BatchNorm priced 20 times its roofline (a CPU's training-mode BatchNorm is 8 times it,
    ``fxopt.analysis.costmodel``): at 0.95 of the kept bytes, a light region over two layers
    recomputes their concatenations for less than a selective one recomputes them and their
    BatchNorms; the plan trains like the original and its peak is predicted exactly."""
    torch.manual_seed(0)
    model, x = DenseBlock(), torch.randn(2, 3, 16, 16)
    gm = trace(model, x)
    problem, forward = build_problem(gm, profile=False)
    problem.nodes = [dataclasses.replace(n, seconds=n.seconds * 20)
                     if n.name.startswith("norms") else n for n in problem.nodes]
    budget = int(problem.kept_without_checkpointing() * 0.95)
    without = plan_checkpoints(problem, budget, modes=(FULL, SELECTIVE))
    plan = plan_checkpoints(problem, budget)
    assert [(r.mode, r.start, r.stop) for r in plan.regions] == [(LIGHT, 4, 12)]
    assert [r.mode for r in without.regions] == [SELECTIVE]
    assert plan.extra_seconds < without.extra_seconds / 2
    apply_plan(gm, forward, plan)
    gm.recompile()
    assert_same_step(step_record(gm, x), step_record(model, x))
    measured = measure_train_step(gm, x).peak_bytes
    assert measured == estimate_train_peak(gm, (x,)).bytes
    assert measured < measure_train_step(model, x).peak_bytes


def test_compiled_light_region_matches_the_original(model_and_input):
    model, x = model_and_input
    gm = light_planned(model, x, 3, 7)
    torch.compiler.reset()
    compiled = torch.compile(gm, backend="aot_eager")
    assert_same_step(step_record(gm, x, call=compiled), step_record(model, x),
                     buffer_tolerance={"rtol": 1e-6, "atol": 1e-7})


def node(name, *, light=False, heavy=False, reads=(), saved=(), mutates=None) -> NodeInfo:
    return NodeInfo(name, 1e-3, saved=frozenset(saved), reads=frozenset(reads), heavy=heavy,
                    light=light, mutates=mutates)


def test_a_light_region_keeps_all_but_its_light_nodes():
    nodes = [node("conv", heavy=True), node("cat", light=True, reads=("conv",)),
             node("bn", reads=("cat",), saved=("cat",))]
    assert kept_names(nodes, LIGHT) == {"conv", "bn"}
    assert kept_names(nodes, SELECTIVE) == {"conv"}
    assert _light_allowed(nodes)


def test_light_regions_whose_recomputation_would_read_a_written_value_are_refused():
    # a kept node overwrites in place what a light node read before it: the kept value is the
    # written one, the forward's light node read the value before the write
    read_then_written = [node("bn"), node("scale", light=True, reads=("bn",)),
                         node("relu_", reads=("bn",), mutates="bn")]
    assert not _light_allowed(read_then_written)
    # written first, then read: the kept value is what the light node read
    written_then_read = [node("bn"), node("relu_", reads=("bn",), mutates="bn"),
                         node("scale", light=True, reads=("bn",))]
    assert _light_allowed(written_then_read)
    # a kept node overwrites a light node's output: recomputation rebuilds it unwritten
    writes_light_output = [node("conv", heavy=True),
                           node("cat", light=True, reads=("conv",)),
                           node("relu_", reads=("cat",), mutates="cat")]
    assert not _light_allowed(writes_light_output)
    # a node after the region overwrites a kept value the light node reads (index 3 >= end 2)
    read_then_written_after = [node("bn"), node("scale", light=True, reads=("bn",))]
    assert _light_allowed(read_then_written_after, {"bn": 1}, end=2)
    assert not _light_allowed(read_then_written_after, {"bn": 3}, end=2)
    # nothing to recompute, or what a selective region keeps: not offered as light
    assert not _light_allowed([node("conv", heavy=True), node("bn", reads=("conv",))])
    assert not _light_allowed([node("conv", heavy=True), node("add", light=True,
                                                                reads=("conv",))])


def test_light_ops_are_pointwise_copies_and_views_without_writes_or_random_numbers():
    aten = torch.ops.aten
    assert all(is_light(op) for op in (aten.cat.default, aten.add.Tensor, aten.mul.Tensor,
                                       aten.view.default, aten._to_copy.default,
                                       aten.relu.default))
    assert not any(is_light(op) for op in (aten.relu_.default, aten.add_.Tensor,
                                           aten.native_dropout.default, aten.mm.default,
                                           aten.native_batch_norm.default, aten.mean.dim))


def test_a_light_region_deep_copies_as_code(model_and_input):
    model, x = model_and_input
    clone = copy.deepcopy(light_planned(model, x, 3, 7))
    region = next(v for v in vars(clone).values() if isinstance(v, CheckpointedRegion))
    assert region.light
    assert_same_step(step_record(clone, x), step_record(model, x))
