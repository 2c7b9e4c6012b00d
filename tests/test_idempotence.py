"""Optimizing an optimized model changes nothing and still verifies against the original.

``fxopt.optimize(optimized, inputs)`` traces the optimized GraphModule again (its own generated
code: in-place activations, a reordered graph, the train/eval dispatch) and runs the same passes:
every pass must report ``modified=False``, the graph must be the same computation (node names may
differ), and the result must still equal the original model, owning its Parameter objects.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxopt
from fxopt.graph.train_eval import has_eval_graph, same_graph
from fxopt.runtime.regions import CheckpointedRegion


class Gate(nn.Module):
    """Data-dependent: kept as an opaque leaf, on the first trace and on the second."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) if x.mean() > 0 else -self.lin(x)


class Net(nn.Module):
    """Conv/BN/ReLU with a residual, dropout that depends on self.training, and a leaf."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.gate = Gate()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        y = F.dropout(self.c2(y), 0.2, self.training) + y
        return self.head(self.gate(torch.relu(y).mean((2, 3))))


def make() -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Net(), torch.randn(2, 3, 12, 12)


@pytest.mark.parametrize("passes", [None, ["inplace"], ["reorder"]])
def test_optimizing_twice_changes_nothing(passes):
    model, x = make()
    once = fxopt.optimize(model, x, passes=passes)
    twice = fxopt.optimize(once, x, passes=passes)
    assert not any(r.modified for r in twice.fxopt_report.passes)
    assert same_graph(once.graph, twice.graph, twice), f"{once.code}\nvs\n{twice.code}"
    assert has_eval_graph(once) and has_eval_graph(twice)  # F.dropout(..., self.training)
    assert [leaf.path for leaf in twice.fxopt_report.trace.leaves] == ["gate"]
    assert fxopt.verify(model, twice, x).ok
    assert [id(p) for p in twice.parameters()] == [id(p) for p in model.parameters()]
    assert list(twice.state_dict()) == list(model.state_dict())


def test_the_first_run_did_change_something():
    """Otherwise the test above would prove nothing."""
    model, x = make()
    once = fxopt.optimize(model, x)
    assert any(r.modified for r in once.fxopt_report.passes)


def test_optimizing_a_checkpointed_model_twice_changes_nothing():
    model, x = make()
    once = fxopt.optimize(model, x, memory_budget=0.9)
    assert any(r.name == "checkpoint" and r.modified for r in once.fxopt_report.passes)
    twice = fxopt.optimize(once, x, memory_budget=0.9)
    assert not any(r.modified for r in twice.fxopt_report.passes)
    assert fxopt.verify(model, twice, x).ok
    regions = [getattr(twice, n.target) for n in twice.graph.nodes
               if n.op == "get_attr" and isinstance(getattr(twice, n.target), CheckpointedRegion)]
    assert regions, twice.code
    # the regions run on twice's own modules, looked up at call time, so eval() reaches them
    assert all(r.targets for r in regions)
    assert not any(t.numel() for r in regions for t in [*r.body.parameters(), *r.body.buffers()])
    twice.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(twice(x), model(x))
