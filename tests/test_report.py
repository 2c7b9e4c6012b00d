"""The report an optimized module carries: predicted memory before/after by default."""

import json

import torch
from torch import nn

import fxopt


def small_cnn() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_report_predicts_memory_before_and_after_by_default():
    torch.manual_seed(0)
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    report = fxopt.optimize(model, x, memory_budget="min").fxopt_report
    before, after = report.predicted_before, report.predicted_after
    assert after.train_bytes < before.train_bytes  # checkpointing lowered it
    assert before.train_bytes == fxopt.estimate_peak(fxopt.trace(model, x), x).train_bytes
    text = str(report)
    assert "train peak, predicted" in text and "inference peak, predicted" in text
    assert "activations at it, predicted" in text
    row = next(line for line in text.splitlines() if "train peak, predicted" in line)
    assert row.rstrip().endswith("%") and "-" in row.split()[-1]  # a saving, as a change
    as_dict = json.loads(json.dumps(report.as_dict()))
    assert as_dict["predicted_before"]["train_bytes"] == before.train_bytes
    assert as_dict["predicted_after"]["activation_bytes"] == after.activation_bytes


def test_pass_statistics_print_sizes_in_mib():
    torch.manual_seed(0)
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    text = str(fxopt.optimize(model, x, memory_budget="min").fxopt_report)
    line = next(line for line in text.splitlines() if line.strip().startswith("checkpoint"))
    assert "predicted_before=" in line and "KiB" in line.split("predicted_before=")[1][:12]


def test_prediction_can_be_turned_off():
    torch.manual_seed(0)
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    report = fxopt.optimize(model, x, predict_memory=False).fxopt_report
    assert report.predicted_before is None and "predicted" not in str(report).split("verification")[0]


def test_report_says_how_long_each_phase_took():
    torch.manual_seed(0)
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    report = fxopt.optimize(model, x).fxopt_report
    assert set(report.seconds) == {"capture", "predict", "passes", "verify"}
    assert all(v > 0 for v in report.seconds.values())
    assert report.seconds["passes"] >= sum(p.seconds for p in report.passes)
    assert report.total_seconds == sum(report.seconds.values())
    assert f"time: {report.total_seconds:.2f} s (capture " in str(report)
    assert report.as_dict()["seconds"]["total"] == report.total_seconds


def test_the_report_prints_typed_pass_stats_it_knows_nothing_about():
    """A pass's per-site stats are ``StatsItem``s it defines: the report prints their own
    ``line()`` and writes ``as_dict()`` to JSON, for a pass of one's own as for the built-in
    checkpoint pass (the report names no pass and reads no key)."""
    from dataclasses import dataclass

    from fxopt import passes
    from fxopt.rewrite.pass_base import PassResult, StatsItem
    from fxopt.rewrite.registry import PassSpec

    @dataclass(frozen=True)
    class Counted(StatsItem):
        node: str
        users: int

        def line(self) -> str:
            return f"counted {self.node}: {self.users} user(s)"

    def count_users(gm):
        items = [Counted(n.name, len(n.users)) for n in gm.graph.nodes if n.op == "call_module"]
        return PassResult(gm, False, {"counted": len(items), "sites": items})

    registry = passes.REGISTRY.with_pass(PassSpec("count_users", count_users, "counts users"))
    torch.manual_seed(0)
    model, x = small_cnn(), torch.randn(2, 3, 16, 16)
    gm = fxopt.optimize(model, x, passes=["checkpoint", "count_users"], memory_budget="min",
                        registry=registry, verify=False)
    text = str(gm.fxopt_report)
    sites = next(r for r in gm.fxopt_report.passes if r.name == "count_users").stats["sites"]
    assert sites and all(f"    counted {s.node}: {s.users} user(s)" in text for s in sites)
    assert "counted=" in text
    regions = next(r for r in gm.fxopt_report.passes if r.name == "checkpoint").stats["regions"]
    assert regions and all(f"    {r.line()}" in text for r in regions)
    assert "keeps" in regions[0].line() and "ms predicted" in regions[0].line()
    as_dict = json.loads(json.dumps(gm.fxopt_report.as_dict()))
    records = {r["name"]: r for r in as_dict["passes"]}
    assert records["count_users"]["stats"]["sites"][0] == {"node": sites[0].node,
                                                           "users": sites[0].users}
    assert records["checkpoint"]["stats"]["regions"][0]["kept_bytes_saved"] == (
        regions[0].kept_bytes_saved)
