"""passes.reorder: a memory-aware schedule where the written order keeps two temporaries alive."""

import torch
from helpers import check_pass
from torch import fx, nn

from fxopt.analysis import alias_classes
from fxopt.capture.trace import trace
from fxopt.measure.peaks import measure_inference, measure_train_step
from fxopt.planning.schedule import (MIN_PROMISED_SAVING, candidate_orders, dependencies,
                                     static_peak)
from fxopt.verify.equivalence import verify
from fxopt.passes.reorder import reorder


class TwoBranches(nn.Module):
    """Two wide temporaries reduced to narrow sums, written so both are alive at once."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        wide_a = torch.cat([x, x, x, x], dim=1) * 2.0
        wide_b = torch.cat([x, x, x, x], dim=1) * 3.0
        return self.head(wide_a.sum(dim=2) + wide_b.sum(dim=2))


BEFORE = """
    x = input
    cat = cat([x, x, x, x], dim=1)
    mul = mul(cat, 2.0)
    cat_1 = cat([x, x, x, x], dim=1)
    mul_1 = mul(cat_1, 3.0)
    sum_1 = .sum(mul, dim=2)
    sum_2 = .sum(mul_1, dim=2)
    add = add(sum_1, sum_2)
    head = head:Linear(add)
    return head
"""
AFTER = """
    x = input
    cat_1 = cat([x, x, x, x], dim=1)
    mul_1 = mul(cat_1, 3.0)
    sum_2 = .sum(mul_1, dim=2)
    cat = cat([x, x, x, x], dim=1)
    mul = mul(cat, 2.0)
    sum_1 = .sum(mul, dim=2)
    add = add(sum_1, sum_2)
    head = head:Linear(add)
    return head
"""


def test_two_branches_are_scheduled_one_after_the_other_and_measure_lower():
    model, x = TwoBranches(), torch.randn(8, 8, 1024)
    gm, result = check_pass(model, (x,), reorder, golden_before=BEFORE, golden_after=AFTER)
    assert result.stats["predicted_after"] < result.stats["predicted_before"]
    original = trace(model, (x,))
    # one wide temporary (8 x 32 x 1024 floats) is no longer alive next to the other; the new
    # order holds one narrow sum (8 x 32 floats) while the second branch runs
    saved = measure_train_step(original, (x,)).peak_bytes - measure_train_step(gm, (x,)).peak_bytes
    assert saved == 8 * 32 * 1024 * 4 - 8 * 32 * 4
    assert result.stats["predicted_after"] == measure_train_step(gm, (x,)).peak_bytes


def test_inference_objective_also_reorders():
    model, x = TwoBranches(), torch.randn(8, 8, 1024)
    gm, result = check_pass(model, (x,), reorder, options={"train": False}, golden_after=AFTER)
    assert measure_inference(gm, (x,)).peak_bytes < measure_inference(trace(model, (x,)),
                                                                     (x,)).peak_bytes


def test_a_chain_has_nothing_to_reorder():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    gm, result = check_pass(model, (torch.randn(3, 4),), reorder, expect_modified=False)
    assert result.stats["strategy"] == "original"
    assert "static screen" in result.stats["reason"]


class TwoBranchesBesideALargeValue(TwoBranches):
    """TwoBranches while a value 400 times larger than either temporary stays alive."""

    def forward(self, x, large):
        held = large * 1.0
        return super().forward(x) + held.sum()


def test_a_saving_too_small_to_matter_is_not_scored():
    """The screen promises one temporary less, well under 1% of the peak: no fake run is made
    to confirm it and the graph stays as written."""
    model, x, large = TwoBranchesBesideALargeValue(), torch.randn(1, 8, 64), torch.randn(400, 8192)
    gm, result = check_pass(model, (x, large), reorder, expect_modified=False)
    screened = result.stats["screened"]
    best = min(screened.values())
    assert 0 < screened["original"] - best < MIN_PROMISED_SAVING * screened["original"]
    assert "candidates" not in result.stats and "1%" in result.stats["reason"]


class RandomBranches(nn.Module):
    """Dropout in both branches: swapping them would swap the RNG draws (different masks)."""

    def __init__(self):
        super().__init__()
        self.drop_a = nn.Dropout(0.5)
        self.drop_b = nn.Dropout(0.5)
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        wide_a = self.drop_a(torch.cat([x, x, x, x], dim=1))
        wide_b = self.drop_b(torch.cat([x, x, x, x], dim=1))
        return self.head(wide_a.sum(dim=2) + wide_b.sum(dim=2))


def test_rng_consumers_keep_their_relative_order():
    model, x = RandomBranches(), torch.randn(8, 8, 256)
    gm = trace(model, (x,))
    deps = dependencies(gm)
    drops = [n for n in gm.graph.nodes if n.op == "call_module" and "drop" in n.target]
    assert drops[0] in deps[drops[1]]
    for name, order in candidate_orders(gm, set()).items():
        assert order.index(drops[0]) < order.index(drops[1]), name
    reorder(gm)
    gm.recompile()
    assert verify(model, gm, (x,)).ok  # same masks, so the same outputs and gradients


class ReadThenReluInPlace(nn.Module):
    """``x * 2`` reads ``x`` before an ``nn.ReLU(inplace=True)`` overwrites it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, inp):
        x = self.conv(inp)
        doubled = x * 2
        return doubled + self.relu(x)


def test_an_in_place_module_stays_after_every_earlier_reader_of_its_input():
    gm = trace(ReadThenReluInPlace(), (torch.randn(1, 3, 4, 4),))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["mul"] in dependencies(gm)[nodes["relu"]]
    for name, order in candidate_orders(gm, set()).items():
        assert order.index(nodes["mul"]) < order.index(nodes["relu"]), name


def test_static_peak_counts_a_storage_once_and_keeps_saved_values():
    model, x = TwoBranches(), torch.randn(2, 8, 64)
    gm = trace(model, (x,))
    aliases = alias_classes(gm)
    order = list(gm.graph.nodes)
    wide = 2 * 32 * 64 * 4
    nodes = {n.name: n for n in order}
    assert static_peak(order, aliases, set()) == 3 * wide  # mul, cat_1 and mul_1 at once
    saved = {nodes["cat"], nodes["cat_1"]}  # as if both cats were kept for backward
    assert static_peak(order, aliases, saved) == 4 * wide + 2 * 32 * 4  # ... and sum_1 as well


def test_reorder_of_an_fx_graph_keeps_the_codegen():
    model, x = TwoBranches(), torch.randn(4, 8, 512)
    gm = trace(model, (x,))
    codegen = type(gm.graph._codegen)
    reorder(gm)
    assert isinstance(gm.graph, fx.Graph) and type(gm.graph._codegen) is codegen


class IndependentDropouts(nn.Module):
    """Two random ops with no data dependence: a schedule that swapped them would hand each the
    other's random numbers."""

    def forward(self, x, y):
        a = torch.nn.functional.dropout1d(x, 0.5, training=True)
        b = torch.nn.functional.dropout3d(y.unsqueeze(0), 0.5, training=True)
        c = torch.nn.functional.feature_alpha_dropout(y, 0.5, training=True)
        return a.sum() + b.sum() + c.sum()


def test_random_ops_keep_their_relative_order():
    gm = trace(IndependentDropouts(), (torch.randn(2, 4, 8), torch.randn(2, 4, 8, 8)))
    deps = dependencies(gm)
    drops = [n for n in gm.graph.nodes if "dropout" in str(n.target)]
    assert len(drops) == 3
    assert drops[0] in deps[drops[1]] and drops[1] in deps[drops[2]]
