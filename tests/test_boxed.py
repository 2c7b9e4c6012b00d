"""fxopt.rewrite.boxed.release_inputs: the forward frees inputs the caller hands over; and the
boxed code of checkpointed regions, generated on their first call without grad, holds nothing
of that call afterwards."""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fxopt
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.capture.trace import trace
from fxopt.rewrite.boxed import release_inputs
from fxopt.runtime.regions import CheckpointedRegion


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


@torch.fx.wrap
def doubled(x):
    return x * 2


class WrappedCallBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 512), nn.Linear(512, 64)

    def forward(self, x):
        return x + self.down(doubled(torch.tanh(self.up(x))))


class _Made(TorchDispatchMode):
    """Weak references to every tensor the ops run inside make."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made.extend(weakref.ref(t) for t in pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor))
        return out


def test_a_regions_first_call_without_grad_leaves_no_cycle_holding_tensors():
    """A region body that calls a ``torch.fx.wrap``-ed function has code that registers it
    again when run, and ``torch.fx.wrap`` keeps its frame, and so every frame below it, in a
    reference cycle. Run while generating a region's boxed code, on its first call without grad
    (an evaluation), that cycle held the evaluating forward's tensors until the next garbage
    collection: six of this model's, on a GPU the first evaluation's activations, and in fxopt's
    predictions a peak that depended on when the collector ran. With the collector off, every
    tensor the call made but its output is gone once it returns."""
    torch.manual_seed(0)
    model = nn.Sequential(*(WrappedCallBlock() for _ in range(6)))
    x = torch.randn(512, 64)
    gm = fxopt.optimize(model, x, memory_budget="min")
    regions = [value for module in gm.modules() for value in vars(module).values()
               if isinstance(value, CheckpointedRegion)]
    assert regions and all("wrap(" in region.body.code for region in regions)
    fresh = copy.deepcopy(gm)  # new bodies, whose boxed code the call below generates
    with torch.no_grad():
        expected = model(x)
    watch = _Made()
    gc.disable()
    try:
        with torch.no_grad(), watch:
            out = fresh(x)
        torch.testing.assert_close(out, expected)
        del out
        alive = [tuple(t.shape) for ref in watch.made if (t := ref()) is not None]
    finally:
        gc.enable()
    assert alive == [], f"tensors the call made, held after it returned: {alive}"
