"""passes/causal_attention.py: a built causal mask becomes sdpa's is_causal=True, and only then."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxopt
from fxopt.capture.chain import capture
from passes.causal_attention import SDPA, causal_attention

B, T, C, H = 3, 8, 16, 2


class Attention(nn.Module):
    """``mask(T, x)`` builds the mask the way the case under test does."""

    def __init__(self, mask, cross: bool = False):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.mask = mask
        self.cross = cross

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(x.shape[0], -1, H, C // H).transpose(1, 2) for t in (q, k, v))
        if self.cross:
            k, v = k[:, :, : T // 2], v[:, :, : T // 2]
        mask = self.mask(x.shape[1], x, pad)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


def bool_causal(t, x, pad):
    return torch.ones(t, t, dtype=torch.bool, device=x.device).tril()


def float_causal(t, x, pad):
    upper = torch.ones(t, t, device=x.device).triu(1).bool()
    return torch.zeros(t, t, device=x.device).masked_fill(upper, float("-inf"))


def batched_causal(t, x, pad):  # transformers' shape: (batch, 1, T, T), from arange comparisons
    rows = torch.arange(t, device=x.device)
    causal = rows[None, :] <= rows[:, None]
    return causal[None, None].expand(x.shape[0], 1, t, t)


def padded(t, x, pad):  # causal and padding: reads the input's values
    return bool_causal(t, x, pad) & pad[:, None, None, :]


def anti_causal(t, x, pad):
    return torch.ones(t, t, dtype=torch.bool, device=x.device).triu()


def inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, C, generator=gen)
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[0, -2:] = False
    return x, pad


def sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.target is SDPA]


@pytest.mark.parametrize("mask", [bool_causal, float_causal, batched_causal])
def test_a_built_causal_mask_becomes_is_causal_and_its_computation_goes(mask):
    model = Attention(mask)
    gm = capture(model, inputs(), capture="export")
    before = len(gm.graph.nodes)
    result = causal_attention(gm)
    assert result.modified and result.stats["rewritten"] == 1, result.stats
    (call,) = sdpa_calls(gm)
    assert call.args[3] is None and call.args[5] is True
    assert len(gm.graph.nodes) < before  # the mask's arange/tril/... are dead and removed
    torch.manual_seed(0)
    expected = model(*inputs())
    torch.testing.assert_close(gm(*inputs()), expected)
    optimized = fxopt.optimize(model, inputs(), capture="export")
    assert optimized.fxopt_report.verification.ok
    record = next(p for p in optimized.fxopt_report.passes if p.name == "causal_attention")
    assert record.modified


@pytest.mark.parametrize("mask, reason", [
    (padded, "reads an input's values"),
    (anti_causal, "not the causal pattern"),
])
def test_masks_that_are_not_causal_stay(mask, reason):
    gm = capture(Attention(mask), inputs(), capture="export")
    result = causal_attention(gm)
    assert not result.modified
    (why,) = result.stats["skipped"].values()
    assert reason in why
    (call,) = sdpa_calls(gm)
    assert call.args[3] is not None


def test_cross_attention_of_other_lengths_stays():
    def rectangular(t, x, pad):
        return torch.ones(t, t // 2, dtype=torch.bool, device=x.device).tril()

    gm = capture(Attention(rectangular, cross=True), inputs(), capture="export")
    result = causal_attention(gm)
    assert not result.modified
    (why,) = result.stats["skipped"].values()
    assert "not the causal pattern" in why or "lengths differ" in why


def test_a_batch_size_the_example_did_not_have_still_matches():
    # weights and input fixed: the is_causal kernel rounds differently from the masked one
    torch.manual_seed(0)
    model = Attention(batched_causal)
    gm = fxopt.optimize(model, inputs(), capture="export")
    x = torch.randn(B + 2, T, C, generator=torch.Generator().manual_seed(1))
    pad = torch.ones(B + 2, T, dtype=torch.bool)
    model.eval()
    gm.eval()
    torch.testing.assert_close(gm(x, pad), model(x, pad))
