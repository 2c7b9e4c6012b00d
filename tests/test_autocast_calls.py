"""A module torch.export captured runs under the autocast it was captured in, or says so first.

torch.export traces one step: under autocast it builds the casts autocast made into the graph;
in full precision it turns a cast that was a no-op (a Llama RMSNorm's ``.to(torch.float32)``)
into a check of the dtype. Trained under ``torch.autocast`` (Trainer's ``bf16=True``) after
being optimized outside it, an optimized Hugging Face Llama failed mid-call in torch's check
with a bare ``RuntimeError: Tensor dtype mismatch``; optimized under autocast and then
evaluated in full precision, it failed the same way (a graph without such a check would have
computed in bfloat16 where the model computes in float32). The input guard now refuses a call
under another autocast than the capture's, before any compute, saying where to call
``fxopt.optimize``; a full-precision capture without dtype checks runs under autocast as the
model does, since every operation of its graph goes through the call's autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxopt
from helpers import FailAt, grouped_query_llama, seeded

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _step(module: nn.Module, ids: torch.Tensor, autocast: bool) -> tuple:
    module.zero_grad(set_to_none=True)
    with torch.autocast(**BF16, enabled=autocast):
        out = module(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("captured_under", [False, True], ids=["full", "bf16"])
def test_a_llama_runs_under_its_captures_autocast_and_refuses_another_before_any_compute(
        captured_under):
    model, ids = grouped_query_llama(), _ids()
    with torch.autocast(**BF16, enabled=captured_under):
        slim = fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                              memory_budget="min")
    assert slim.fxopt_report.trace.frontend == "export"
    loss, grads = _step(slim, ids, captured_under)
    expected_loss, expected = _step(copy.deepcopy(model), ids, captured_under)
    torch.testing.assert_close(loss, expected_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=name)

    captured = "under bfloat16 autocast on cpu" if captured_under else "in full precision"
    called = "in full precision" if captured_under else "under bfloat16 autocast on cpu"
    with FailAt() as ops, pytest.raises(fxopt.InputError) as caught:
        with torch.autocast(**BF16, enabled=not captured_under):
            slim(input_ids=ids, labels=ids)
    assert ops.calls == 0
    assert f"captured by torch.export {captured}, and this call runs {called}" in str(caught.value)
    if not captured_under:
        assert 'with torch.autocast("cpu", dtype=torch.bfloat16): optimized = fxopt.optimize' \
            in caught.value.hint


class Mlp(nn.Module):
    """No cast in forward: nothing for torch.export to turn into a dtype check."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x):
        return self.net(x).square().mean()


def test_a_full_precision_capture_without_dtype_checks_runs_under_autocast_as_the_model():
    model = seeded(Mlp)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    slim = fxopt.optimize(model, (x,), capture="export", memory_budget="min")
    for module in (model, slim):
        module.zero_grad(set_to_none=True)
    with torch.autocast(**BF16):
        losses = [module(x) for module in (model, slim)]
    for loss in losses:
        loss.backward()
    assert losses[1].dtype == losses[0].dtype
    torch.testing.assert_close(losses[1], losses[0])
