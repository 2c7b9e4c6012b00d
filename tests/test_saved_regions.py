"""An optimized module saved with ``torch.save`` and loaded trains like the original, its regions
still checkpointed.

torch.fx pickles a GraphModule as its code and re-traces that code on load. Traced into, fxopt's
own calls changed what the loaded module did: a region's recompute graph calls
``recomputed_batch_norm`` on a stand-in module, which the re-trace recorded as a call of the
BatchNorm itself, so every backward updated its running statistics a second time (silently); a
block's ``call_region`` was traced into and inlined, so the loaded module no longer
checkpointed. fxopt's calls are now marked as ``torch.fx.wrap`` marks them
(``fxopt.core.modules.wrap_own_calls``), and graphs no tracer made are re-traced by
``fxopt.graph.pickling.ReloadTracer``, which records a region as the attribute it is."""

import io

import pytest
import torch
from helpers import assert_same_step, step_record
from test_light_regions import DenseBlock
from test_region_graphs import TwoBlocks
from torch import fx, nn

import fxopt
from fxopt.runtime.regions import CheckpointedRegion, call_region


class Residual(nn.Module):
    """Four repeated residual MLP blocks (kept as calls of their own: ``keep_blocks``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
            for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def saved_and_loaded(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def region_calls(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes if n.target is call_region)


def region_kinds(module: nn.Module) -> set[str]:
    regions = [v for m in module.modules() for v in vars(m).values()
               if isinstance(v, CheckpointedRegion)]
    return {"light" if r.light else "selective" if r.selective else "full" for r in regions}


@pytest.mark.parametrize("make, shape, budget, capture, kinds", [
    (lambda: TwoBlocks(dropout=0.3), (2, 3, 8, 8), "min", "fx", {"selective"}),
    (DenseBlock, (2, 3, 16, 16), 0.8, "fx", None),
    (Residual, (512, 64), 0.9, "fx", None),
    (Residual, (512, 64), 0.9, "export", None),
], ids=["batch-norm-dropout", "dense-block", "blocks-fx", "blocks-export"])
def test_a_loaded_module_trains_like_the_original_and_still_checkpoints(make, shape, budget,
                                                                        capture, kinds):
    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    gm = fxopt.optimize(model, x, memory_budget=budget, capture=capture)
    assert region_calls(gm) > 0
    if kinds is not None:
        assert region_kinds(gm) == kinds
    loaded = saved_and_loaded(gm)
    assert region_calls(loaded) == region_calls(gm)
    assert region_kinds(loaded) == region_kinds(gm)
    assert_same_step(step_record(loaded, x, seed=3), step_record(model, x, seed=3))
