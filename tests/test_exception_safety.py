"""An error inside the optimized forward leaves global state as eager PyTorch does.

torch.export records ``torch.no_grad()`` inside a model as ``wrap_with_set_grad_enabled``, whose
eager form restores grad mode only when its body returns; fxopt's graphs call
``fxopt.runtime.scoped`` instead. Failures are injected at every ATen operator a training step of
a small export-captured, checkpointed model runs (forward, recomputation and backward), by a
dispatch mode that raises at the k-th operator: after each caught error, grad mode and autocast
are what they were.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxopt
from helpers import FailAt, Injected
from fxopt.runtime.scoped import grad_mode_scope


class WithNoGrad(nn.Module):
    """A model whose forward turns grad off for a part (a rotary table, as Llama's) and runs a
    part under autocast turned off, so export records both state changes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 4)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 64))

    def forward(self, x):
        with torch.no_grad():
            table = torch.cos(self.freq * x.shape[1]).unsqueeze(0)
        h = torch.relu(self.inp(x)) * table
        with torch.autocast("cpu", enabled=False):
            h = torch.tanh(h.float())
        h = torch.sigmoid(self.mid(h)) * h
        return self.out(torch.relu(h))


def _optimized(autocast: bool = False):
    """The model, optimized at "min" under the autocast it then runs under (an export capture
    runs under the autocast it was captured in)."""
    torch.manual_seed(0)
    model, x = WithNoGrad(), torch.randn(256, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        slim = fxopt.optimize(model, (x,), capture="export", memory_budget="min")
    return model, slim, x


def test_captured_state_changes_are_scoped():
    _, slim, _ = _optimized()
    # a scope may sit in the root's graph, a block's (fxopt.rewrite.blocks) or a region body's
    graphs = [m.graph for m in slim.modules() if isinstance(m, torch.fx.GraphModule)]
    graphs += [v.body.graph for m in slim.modules() for v in vars(m).values()
               if type(v).__name__ == "CheckpointedRegion"]
    targets = {n.target for g in graphs for n in g.nodes if n.op == "call_function"}
    assert grad_mode_scope in targets
    assert not any("wrap_with_set_grad_enabled" in str(t) for t in targets)


def _step(module, x):
    module(x).square().sum().backward()


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_an_error_at_any_operator_leaves_grad_mode_and_autocast_as_before(autocast):
    model, slim, x = _optimized(autocast)
    assert any(type(v).__name__ == "CheckpointedRegion"
               for m in slim.modules() for v in vars(m).values())
    counter = FailAt()
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _step(slim, x)
    total = counter.calls
    assert total > 20
    for at in range(1, total + 1):
        grad_before = torch.is_grad_enabled()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with pytest.raises(Injected):
                with FailAt(at):
                    _step(slim, x)
            assert torch.is_autocast_enabled("cpu") == autocast, at
        assert torch.is_grad_enabled() == grad_before, f"grad mode left changed by a failure at op {at}"
        assert not torch.is_autocast_enabled("cpu")
        slim.zero_grad(set_to_none=True)
    # and the module still trains like the model after all those failures
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _step(slim, x)
    grads = {n: p.grad.clone() for n, p in slim.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _step(model, x)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


def test_the_hop_torch_export_records_does_not_restore_grad_mode():
    """The control: torch's own eager wrapper leaves grad mode off after an error (the bug the
    scope fixes; if torch fixes it, this test says so)."""
    def body(x):
        raise Injected("inside")

    with pytest.raises(Injected):
        torch.ops.higher_order.wrap_with_set_grad_enabled(False, body, torch.ones(1))
    left_off = not torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    assert left_off
    with pytest.raises(Injected):
        grad_mode_scope(False, body, torch.ones(1))
    assert torch.is_grad_enabled()
