"""passes/causal_attention.py: a built causal mask becomes sdpa's is_causal=True, and only then."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxopt
from fxopt.capture.chain import capture
from helpers import check_pass, grouped_query_llama, token_batch
from fxopt.passes.causal_attention import SDPA, causal_attention

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
    # one capture: optimize starts from a copy of it (never edited), the pass then runs on it
    gm = fxopt.capture_model(model, inputs(), capture="export")
    optimized = fxopt.optimize(model, inputs(), capture="export", captured=gm)
    assert optimized.fxopt_report.verification.ok
    record = next(p for p in optimized.fxopt_report.passes if p.name == "causal_attention")
    assert record.modified
    before = len(gm.graph.nodes)
    result = causal_attention(gm)
    assert result.modified and result.stats["rewritten"] == 1, result.stats
    (call,) = sdpa_calls(gm)
    assert call.args[3] is None and call.args[5] is True
    assert len(gm.graph.nodes) < before  # the mask's arange/tril/... are dead and removed
    torch.manual_seed(0)
    expected = model(*inputs())
    torch.testing.assert_close(gm(*inputs()), expected)


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


GOLDEN_BEFORE = """
    x = input
    pad = input
    qkv_weight = @qkv.weight()
    qkv_bias = @qkv.bias()
    _fxopt_input_guard = @_fxopt_input_guard()
    guard_inputs = guard_inputs(_fxopt_input_guard, x, pad, state=[qkv_weight, qkv_bias])
    sym_size_int_3 = sym_size.int(x, 0)
    sym_size_int_4 = sym_size.int(x, 1)
    linear = linear.default(x, qkv_weight, qkv_bias)
    split = split.Tensor(linear, 16, -1)
    getitem = getitem(split, 0)
    getitem_1 = getitem(split, 1)
    getitem_2 = getitem(split, 2)
    view = view.default(getitem, [sym_size_int_3, -1, 2, 8])
    transpose = transpose.int(view, 1, 2)
    view_1 = view.default(getitem_1, [sym_size_int_3, -1, 2, 8])
    transpose_1 = transpose.int(view_1, 1, 2)
    view_2 = view.default(getitem_2, [sym_size_int_3, -1, 2, 8])
    transpose_2 = transpose.int(view_2, 1, 2)
    tensor_device = tensor_device(qkv_weight)
    arange = arange.default(sym_size_int_4, device=tensor_device, pin_memory=False)
    unsqueeze = unsqueeze.default(arange, 0)
    slice_1 = slice.Tensor(unsqueeze, 1, 0, 9223372036854775807)
    slice_2 = slice.Tensor(arange, 0, 0, 9223372036854775807)
    unsqueeze_1 = unsqueeze.default(slice_2, 1)
    le_2 = le.Tensor(slice_1, unsqueeze_1)
    unsqueeze_2 = unsqueeze.default(le_2, 0)
    unsqueeze_3 = unsqueeze.default(unsqueeze_2, 1)
    expand = expand.default(unsqueeze_3, [sym_size_int_3, 1, sym_size_int_4, sym_size_int_4])
    scaled_dot_product_attention = scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, expand)
    sum_1 = sum.dim_IntList(scaled_dot_product_attention, [1])
    return sum_1
"""

GOLDEN_AFTER = """
    x = input
    pad = input
    qkv_weight = @qkv.weight()
    qkv_bias = @qkv.bias()
    _fxopt_input_guard = @_fxopt_input_guard()
    guard_inputs = guard_inputs(_fxopt_input_guard, x, pad, state=[qkv_weight, qkv_bias])
    sym_size_int_3 = sym_size.int(x, 0)
    linear = linear.default(x, qkv_weight, qkv_bias)
    split = split.Tensor(linear, 16, -1)
    getitem = getitem(split, 0)
    getitem_1 = getitem(split, 1)
    getitem_2 = getitem(split, 2)
    view = view.default(getitem, [sym_size_int_3, -1, 2, 8])
    transpose = transpose.int(view, 1, 2)
    view_1 = view.default(getitem_1, [sym_size_int_3, -1, 2, 8])
    transpose_1 = transpose.int(view_1, 1, 2)
    view_2 = view.default(getitem_2, [sym_size_int_3, -1, 2, 8])
    transpose_2 = transpose.int(view_2, 1, 2)
    scaled_dot_product_attention = scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True)
    sum_1 = sum.dim_IntList(scaled_dot_product_attention, [1])
    return sum_1
"""


def test_golden_graph_before_and_after_and_a_second_run_changes_nothing():
    """check_pass: golden before -> pass -> invariants -> golden after (the mask's whole
    computation gone, sdpa causal) -> a second run is a no-op with identical code -> forward and
    backward numerics -> measured memory not worse."""
    torch.manual_seed(0)
    gm, result = check_pass(Attention(batched_causal), inputs(), causal_attention,
                            capture="export", golden_before=GOLDEN_BEFORE,
                            golden_after=GOLDEN_AFTER)
    assert result.stats["sites"] == ["scaled_dot_product_attention"]
    again = causal_attention(gm)
    assert not again.modified and again.stats["rewritten"] == 0 and again.stats["skipped"] == {}


class GroupedAttention(nn.Module):
    """Grouped-query attention as transformers writes it traced: 2 query heads on 1 key/value
    head, ``repeat_kv`` (``k[:, :, None].expand(...).reshape(...)``), a built causal mask."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(C, C), nn.Linear(C, C // H * 2)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape[0], x.shape[1], C // H
        q = self.q(x).view(b, t, H, d).transpose(1, 2)
        k, v = (z.view(b, t, 1, d).transpose(1, 2) for z in self.kv(x).split(d, -1))
        return q, k, v

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        b, _, t, d = k.shape
        k, v = (z[:, :, None].expand(b, 1, H, t, d).reshape(b, H, t, d) for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=batched_causal(t, x, pad)).sum(1)


class TiledHeads(GroupedAttention):
    """The key/value head and a scaled copy of it: computed, not a repetition."""

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        k, v = (torch.cat([z, z * 2], dim=1) for z in (k, v))
        mask = batched_causal(x.shape[1], x, pad)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


def test_grouped_heads_are_handed_to_sdpa_unrepeated_once_the_mask_is_gone():
    """check_pass (numerics, measured memory not worse, a second run changes nothing): the
    repeated key and value copies are gone and sdpa groups the heads itself; a batch size the
    example did not have still computes what the model computes."""
    torch.manual_seed(0)
    model = GroupedAttention()
    gm, result = check_pass(model, inputs(), causal_attention, capture="export")
    assert result.stats["sites"] == result.stats["grouped"] == ["scaled_dot_product_attention"]
    (call,) = sdpa_calls(gm)
    assert call.kwargs == {"enable_gqa": True} and call.args[3:] == (None, 0.0, True)
    assert call.args[1].meta["val"].shape[1] == 1  # the model's one key/value head
    assert not [n for n in gm.graph.nodes if n.target in (torch.ops.aten.expand.default,
                                                           torch.ops.aten.clone.default)]
    x = torch.randn(B + 2, T, C, generator=torch.Generator().manual_seed(1))
    pad = torch.ones(B + 2, T, dtype=torch.bool)
    torch.testing.assert_close(gm(x, pad), model(x, pad))


def test_heads_that_are_computed_not_repeated_stay():
    gm = capture(TiledHeads(), inputs(), capture="export")
    result = causal_attention(gm)
    assert result.stats["grouped"] == [] and result.stats["sites"]  # made causal, not grouped
    (call,) = sdpa_calls(gm)
    assert "enable_gqa" not in call.kwargs and call.args[1].meta["val"].shape[1] == H


class TiledGroups(nn.Module):
    """4 query heads on 2 key/value heads, tiled (heads 0, 1, 0, 1) by the operators
    ``repeat_kv`` uses, a new dimension in front of the heads instead of after: a pure data
    movement, but not the grouping sdpa's ``enable_gqa`` applies (0, 0, 1, 1)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q = self.q(x).view(b, t, 4, C // 4).transpose(1, 2)
        k, v = (z.view(b, t, 2, C // 4).transpose(1, 2) for z in self.kv(x).split(C // 2, -1))
        k, v = (z[:, None].expand(b, 2, 2, t, C // 4).reshape(b, 4, t, C // 4) for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=batched_causal(t, x, pad)).sum(1)


def test_heads_repeated_in_another_order_stay_repeated():
    gm = capture(TiledGroups(), inputs(), capture="export")
    result = causal_attention(gm)
    assert result.stats["grouped"] == [] and result.stats["sites"]
    (call,) = sdpa_calls(gm)
    assert "enable_gqa" not in call.kwargs and call.args[1].meta["val"].shape[1] == 4


def test_a_grouped_query_llama_optimized_by_default_holds_no_more_than_the_original():
    """The eager Llama calls sdpa with ``enable_gqa=True`` and no mask; before this pass handed
    grouped heads over, its default-optimized capture held the repeated key/value copies for
    backward and measured 1,828,424 bytes against the original's 1,795,656 (+1.8%)."""
    model, kwargs = grouped_query_llama(), token_batch(2)
    slim = fxopt.optimize(model, (), example_kwargs=kwargs)
    causal = next(p for p in slim.fxopt_report.passes if p.name == "causal_attention")
    assert len(causal.stats["grouped"]) == 2  # one call per layer
    measured = fxopt.measure_train_step(slim, (), kwargs).peak_bytes
    assert measured <= fxopt.measure_train_step(model, (), kwargs).peak_bytes
    assert measured == slim.fxopt_report.predicted_after.train_bytes
