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
