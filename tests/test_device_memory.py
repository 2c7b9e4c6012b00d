"""fxopt/analysis/device_memory.py and the tracker's workspaces: memory a device's kernels hold
beyond their outputs, measured once and held by every prediction while the op runs.

A CPU's kernels hold nothing the allocator would count, so a probe stands for the GPU's: the
path from the recorded calls to the predicted peak is the one a CUDA run takes."""

from __future__ import annotations

import torch
from torch import nn

import fxopt
from fxopt.analysis.device_memory import measure_device_memory
from fxopt.analysis.estimate import estimate_train_peak
from fxopt.capture.trace import trace
from fxopt.core.training_setup import TrainingSetup
from helpers import seeded

MiB = 2**20


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


X = torch.randn(2, 3, 16, 16)


def _conv_forward_only(workspace: int):
    calls = []

    def probe(func, args, kwargs):
        calls.append(func)
        return workspace if func is torch.ops.aten.convolution.default else 0
    return probe, calls


def test_measured_workspaces_are_held_while_their_op_runs_and_nowhere_else():
    gm = trace(seeded(ConvNet), X)
    plain = estimate_train_peak(gm, X)
    probe, calls = _conv_forward_only(64 * MiB)
    memory = measure_device_memory(gm, X, TrainingSetup(), probe=probe)
    assert torch.ops.aten.convolution_backward.default in calls  # backward's calls are probed
    assert len(memory.workspaces) == 2  # two distinct convolutions
    held = estimate_train_peak(gm, X, training=TrainingSetup(device_memory=memory))
    assert held.op == "convolution (workspace)"
    assert plain.bytes < held.bytes <= plain.bytes + 64 * MiB  # transient: never two at once
    assert estimate_train_peak(gm, X).bytes == plain.bytes  # nothing kept between runs


def test_nothing_is_measured_on_the_cpu_without_a_probe():
    gm = trace(seeded(ConvNet), X)
    assert measure_device_memory(gm, X, TrainingSetup()) is None


def test_estimate_peak_reads_the_workspaces_of_its_training_setup():
    """What every planner reads (the report's predictions, the checkpoint plan) counts them."""
    model = seeded(ConvNet)
    probe, _ = _conv_forward_only(4 * MiB)
    gm = trace(model, X)
    memory = measure_device_memory(gm, X, TrainingSetup(), probe=probe)
    setup = TrainingSetup(device_memory=memory)
    assert fxopt.estimate_peak(gm, X, training=setup).train_bytes > fxopt.estimate_peak(
        gm, X).train_bytes
    assert "workspaces measured on cpu" in setup.describe()
