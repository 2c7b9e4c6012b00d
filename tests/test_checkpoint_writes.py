"""passes.checkpoint: a node that writes a graph input, a parameter or a buffer the graph reads is
never recomputed (``fxopt.planning.checkpoint_problem.writes_state``).

Before, such a node counted as mutating nothing and landed inside the least-memory plan's region:
recomputing ``s.mul_(2)`` on an input failed backward (torch's checkpoint saw its input changed),
and recomputing ``self.scale.add_(1)`` ran on a copy of the buffer as the forward had left it,
so the region was rebuilt with ``scale + 2`` and every gradient before it was wrong, silently.
"""

import copy

import pytest
import torch
from torch import nn

from fxopt.capture.trace import trace
from fxopt.planning.checkpoint_problem import build_problem
from fxopt.passes.checkpoint import checkpoint


class WritesInPlace(nn.Module):
    """Six linear + tanh layers; after the third, an in-place write whose result is read."""

    def __init__(self, target: str, width: int = 32, depth: int = 6):
        super().__init__()
        self.target = target
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("scale", torch.ones(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, s):
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i == 2 and self.target == "input":
                s.mul_(2)
                h = h * s
            elif i == 2 and self.target == "buffer":
                self.scale.add_(1)
                h = h * self.scale
            elif i == 2:  # a buffer only written (a counter): recomputing it is harmless
                self.calls.add_(1)
        return h.sum()


def step(module, x, s):
    torch.manual_seed(0)
    loss = module(x, s)
    loss.backward()
    return loss


@pytest.mark.parametrize("target, writer", [("input", "mul_"), ("buffer", "add_")])
def test_a_write_into_an_input_or_a_read_buffer_is_never_in_a_region(target, writer):
    torch.manual_seed(0)
    model, x, s = WritesInPlace(target), torch.randn(1024, 32), torch.rand(32) + 0.5
    gm = trace(model, (x, s.clone()))
    problem, _forward = build_problem(gm, profile=False)
    assert {n.name: n.recomputable for n in problem.nodes}[writer] is False

    result = checkpoint(gm, budget="min", profile=False)
    assert result.modified  # the layers around the write are still checkpointed
    regions = result.stats["regions"]
    order = [n.name for n in problem.nodes]
    assert not any(order.index(r.first) <= order.index(writer) <= order.index(r.last)
                   for r in regions)
    reference = copy.deepcopy(model)
    s_reference, s_optimized = s.clone(), s.clone()
    assert torch.equal(step(reference, x, s_reference), step(gm, x, s_optimized))
    assert torch.equal(s_reference, s_optimized)  # the input written once, as by the model
    assert torch.equal(reference.scale, gm.scale)
    for (name, p), q in zip(reference.named_parameters(), gm.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_a_buffer_only_written_stays_recomputable():
    torch.manual_seed(0)
    model, x, s = WritesInPlace("counter"), torch.randn(1024, 32), torch.rand(32) + 0.5
    gm = trace(model, (x, s))
    problem, _forward = build_problem(gm, profile=False)
    assert {n.name: n.recomputable for n in problem.nodes}["add_"] is True
    result = checkpoint(gm, budget="min", profile=False)
    order = [n.name for n in problem.nodes]
    assert any(order.index(r.first) <= order.index("add_") <= order.index(r.last)
               for r in result.stats["regions"])  # recomputed, on a copy of the counter
    reference = copy.deepcopy(model)
    step(reference, x, s.clone())
    step(gm, x, s.clone())
    assert int(reference.calls) == int(gm.calls) == 1
