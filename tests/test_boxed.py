"""fxopt.rewrite.boxed.release_inputs: the forward frees inputs the caller hands over."""

import pytest
import torch
from torch import nn

import fxopt
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.capture.trace import trace
from fxopt.rewrite.boxed import release_inputs


class Widen(nn.Module):
    def forward(self, x):
        y = x * 2.0   # last use of x
        z = y * 3.0
        return z.sum()


def inference_peak(call) -> int:
    """Peak of ``call()``, which builds its input inline (so the tracker counts it and no frame of
    the caller holds it)."""
    tracker = LiveStorageTracker()
    with tracker, torch.no_grad():
        call()
    return tracker.peak_bytes


def test_boxed_forward_frees_the_input_after_its_last_use():
    gm = trace(Widen(), (torch.randn(64, 1024),))
    boxed = release_inputs(gm)
    plain = inference_peak(lambda: gm(torch.randn(64, 1024)))
    handed_over = inference_peak(lambda: boxed([torch.randn(64, 1024)]))
    assert plain - handed_over == 64 * 1024 * 4  # x is gone before z is allocated


def test_boxed_module_shares_the_users_state_and_computes_the_same():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    gm = trace(model, (x,))
    boxed = release_inputs(gm)
    args = [x.clone()]
    torch.testing.assert_close(boxed(args), model(x))
    assert args == []
    assert [id(p) for p in boxed.parameters()] == [id(p) for p in model.parameters()]
    assert list(boxed.state_dict()) == list(model.state_dict())


class _TrainOnlyScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if self.training else y


def test_mode_dependent_module_is_refused_not_stripped_of_its_eval_path():
    gm = fxopt.optimize(_TrainOnlyScale(), (torch.randn(2, 4),), verify=False)
    with pytest.raises(fxopt.ConfigError, match="depends on self.training"):
        release_inputs(gm)
