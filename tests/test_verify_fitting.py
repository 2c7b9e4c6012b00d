"""fxopt/verify/fitting.py: the proof runs where it fits, and still catches a planted bug there.

The device's free memory and the original's predicted step are parameters of
``verify_where_it_fits``, so a CPU test stands for a GPU that is short of memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxopt
from fxopt.capture.trace import trace
from fxopt.core.errors import ConfigError, EquivalenceError, InputError
from fxopt.verify import fitting
from fxopt.verify.fitting import first_rows, verify_where_it_fits
from helpers import seeded


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _planted(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """The traced model with its ReLU made a GELU: another function at every batch size."""
    gm = trace(model, x)
    for node in gm.graph.nodes:
        if node.target is torch.relu:
            node.target = torch.nn.functional.gelu
    gm.recompile()
    return gm


X = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(0))


def test_reduced_verifies_the_first_rows_and_a_planted_bug_is_still_caught():
    model = seeded(Net)
    verified = verify_where_it_fits(model, trace(model, X), (X,), mode="reduced")
    assert verified.report.ok and verified.where.startswith("batch 4 of 8 on cpu")
    with pytest.raises(EquivalenceError) as info:
        verify_where_it_fits(model, _planted(model, X), (X,), mode="reduced", strict=True)
    assert info.value.inputs[0].shape[0] == 4  # what the proof ran on


def test_auto_takes_the_largest_batch_whose_step_fits_a_short_device():
    model = seeded(Net)
    step = fitting._step_bytes(model, (X,), fxopt.TrainingSetup())
    free = int(step * fitting.HEADROOM * 0.3)  # full size does not fit; a quarter does
    verified = verify_where_it_fits(model, trace(model, X), (X,), free_bytes=lambda d: free)
    assert verified.where.startswith("batch 2 of 8") and "predicted at" in verified.where
    with pytest.raises(EquivalenceError):
        verify_where_it_fits(model, _planted(model, X), (X,), free_bytes=lambda d: free,
                             strict=True)


def test_an_out_of_memory_error_at_full_size_retries_smaller(monkeypatch):
    model = seeded(Net)
    real = fitting.verify

    def runs_out_at_full_size(reference, candidate, args, **options):
        if args[0].shape[0] == X.shape[0]:
            raise InputError("verify: the reference raised OutOfMemoryError") from (
                torch.OutOfMemoryError("CUDA out of memory"))
        return real(reference, candidate, args, **options)

    monkeypatch.setattr(fitting, "verify", runs_out_at_full_size)
    verified = verify_where_it_fits(model, trace(model, X), (X,), free_bytes=lambda d: 2**40)
    assert verified.where.startswith("batch 4 of 8") and "out of memory" in verified.where


def test_a_batch_the_model_refuses_sends_the_proof_to_full_size_on_the_cpu():
    class FixedBatch(Net):
        def forward(self, x):
            return super().forward(x).view(8, 4)  # the model's own code fixes the batch

    model = seeded(FixedBatch)
    verified = verify_where_it_fits(model, trace(model, X), (X,), mode="reduced")
    assert verified.report.ok and verified.where.startswith("full size on cpu")


def test_first_rows_cuts_only_tensors_of_the_batch_size():
    ids, table = torch.arange(12).view(6, 2), torch.arange(5)
    small = first_rows(({"ids": ids, "table": table}, 3), 6, 2)
    assert small[0]["ids"].tolist() == [[0, 1], [2, 3]] and small[0]["table"] is table
    assert small[1] == 3


def test_optimize_says_where_it_verified_and_refuses_an_unknown_mode():
    model = seeded(Net)
    slim = fxopt.optimize(model, X, verify="reduced")
    assert slim.fxopt_report.verified_where.startswith("batch 4 of 8")
    assert "; ran at batch 4 of 8" in str(slim.fxopt_report)
    assert fxopt.optimize(model, X).fxopt_report.verified_where == "full size on cpu"
    with pytest.raises(ConfigError, match="verify='smaller'"):
        fxopt.optimize(model, X, verify="smaller")
