"""The chunked loss's chunk as a variable of the checkpoint plan (passes/checkpoint.py,
planning/loss_chunks.widest_chunk_rows): open chunks are planned at the smallest size, then
widened as far as the budget (or, for "min", the plan's predicted peak) allows, never above the
predicted (and measured) peak; a chunk size the user fixed stays."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxopt
from fxopt.capture.chain import capture
from fxopt.measure.peaks import measure_train_step
from fxopt.planning.loss_chunks import FAST_CHUNK_ROWS, MIN_CHUNK_ROWS, decide, widest_chunk_rows
from fxopt.runtime.chunked_loss import auto_chunk_rows
from fxopt.runtime.chunked_loss import chunked_loss as chunked_loss_call
from fxopt.passes.checkpoint import checkpoint
from fxopt.rewrite.loss_chunk_calls import LossChunks
from fxopt.passes.chunked_loss import chunked_loss
from helpers import seeded


@settings(max_examples=60, deadline=None)
@given(rows=st.sampled_from([1, 3, 16, 32]), tokens=st.integers(1, 2000),
       limit=st.integers(0, 600))
def test_widest_chunk_is_the_widest_power_of_two_that_fits(rows, tokens, limit):
    asked = []

    def fits(candidate: int) -> bool:
        asked.append(candidate)
        return candidate <= limit

    got = widest_chunk_rows(rows, tokens, fits)
    fitting = [r for r in (2 ** k for k in range(12)) if rows < r <= limit
               and r <= FAST_CHUNK_ROWS and r < 2 * tokens]
    assert got == (min(max(fitting), tokens) if fitting else rows)
    assert len(asked) <= 4  # the widest first, then a bisection of at most 4 sizes


def _ids(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return ids, ids.clone()


class HeadOnly(nn.Module):
    """Nothing but the head: the loss's forward is the training step's peak."""

    def __init__(self, vocab: int = 4096, hidden: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class WideBody(HeadOnly):
    """A wide MLP before the head: its gradient in backward is the peak, the loss is not."""

    def __init__(self, vocab: int = 1024, hidden: int = 8, wide: int = 8192):
        super().__init__(vocab, hidden)
        self.up, self.down = nn.Linear(hidden, wide), nn.Linear(wide, hidden)

    def forward(self, ids, labels):
        logits = self.head(self.down(torch.relu(self.up(self.emb(ids)))))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def _chunked(model: nn.Module, inputs: tuple) -> torch.fx.GraphModule:
    gm = capture(model, inputs)
    assert chunked_loss(gm, force=True).modified
    return gm


def _rows(gm: torch.fx.GraphModule) -> int | None:
    call, = [n for n in gm.graph.nodes if n.target is chunked_loss_call]
    return call.kwargs["chunk_rows"]


def test_chunked_loss_leaves_the_chunk_open_and_the_call_then_takes_the_automatic_size():
    model, inputs = seeded(HeadOnly), _ids(4096, 2, 256)
    gm = _chunked(model, inputs)
    assert _rows(gm) is None and LossChunks(gm).tokens == inputs[0].numel()
    rows = auto_chunk_rows(inputs[0].numel(), 4096, 8, 4)
    fixed = capture(model, inputs)
    chunked_loss(fixed, chunk_rows=rows, force=True)
    assert measure_train_step(gm, inputs).peak_bytes == measure_train_step(
        fixed, inputs).peak_bytes  # None is auto_chunk_rows at run time
    torch.testing.assert_close(gm(*inputs), model(*inputs))


@pytest.mark.parametrize("build, inputs, widened", [
    (HeadOnly, _ids(4096, 2, 256), MIN_CHUNK_ROWS),      # any wider chunk raises the peak
    (WideBody, _ids(1024, 2, 128), FAST_CHUNK_ROWS),     # the chunk is free up to the cap
])
def test_chunks_widen_only_where_the_peak_does_not_rise(build, inputs, widened):
    model = seeded(build)
    narrow, wide = _chunked(model, inputs), _chunked(model, inputs)
    LossChunks(narrow).set(MIN_CHUNK_ROWS)
    result = checkpoint(wide, budget="min")
    assert _rows(wide) == widened == result.stats["loss_chunk_rows"] and result.modified
    measured_narrow = measure_train_step(narrow, inputs).peak_bytes
    measured_wide = measure_train_step(wide, inputs).peak_bytes
    assert measured_wide <= measured_narrow
    assert measured_wide == result.stats["predicted_after"]  # exact on CPU
    loss = wide(*inputs)
    torch.testing.assert_close(loss, model(*inputs))


def test_a_byte_budget_lets_the_chunk_use_the_room_the_plan_leaves():
    """Under a byte budget above the least-memory peak, the chunk widens up to the budget, not
    only up to the plan's own peak (what "min" does)."""
    model, inputs = seeded(HeadOnly), _ids(4096, 2, 256)
    at_min = _chunked(model, inputs)
    least = checkpoint(at_min, budget="min").stats["predicted_after"]
    roomy = _chunked(model, inputs)
    budget = least + 8 * MIN_CHUNK_ROWS * 4096 * 4  # room for chunks several times wider
    result = checkpoint(roomy, budget=budget)
    assert _rows(roomy) > _rows(at_min) == MIN_CHUNK_ROWS
    assert result.stats["predicted_after"] <= budget
    assert measure_train_step(roomy, inputs).peak_bytes <= budget


def test_a_chunk_size_the_user_gave_is_kept():
    model, inputs = seeded(WideBody), _ids(1024, 2, 128)
    gm = capture(model, inputs)
    chunked_loss(gm, chunk_rows=24, force=True)
    assert not LossChunks(gm)
    result = checkpoint(gm, budget="min")
    assert _rows(gm) == 24 and "loss_chunk_rows" not in result.stats


def test_optimize_under_a_budget_sizes_the_chunks_with_the_plan():
    model, inputs = seeded(WideBody, 4096, 8, 2048), _ids(4096, 2, 128)
    gm = fxopt.optimize(model, inputs, memory_budget="min", outputs="loss",
                        passes=["chunked_loss", "reorder"])
    records = {r.name: r for r in gm.fxopt_report.passes}
    assert list(records) == ["chunked_loss", "checkpoint", "reorder", "keep_blocks"]
    site, = records["chunked_loss"].stats["sites"]
    assert site["chunk_rows"] == "open"
    assert records["checkpoint"].stats["loss_chunk_rows"] > MIN_CHUNK_ROWS
    assert gm.fxopt_report.verification.ok


def test_under_a_budget_the_saving_is_judged_at_the_chunk_the_plan_starts_from():
    """64 tokens over 256 logits: at the automatic size (all 64 tokens in one chunk) chunking
    holds more than it removes, at the smallest chunk, where the checkpoint plan starts, less.
    Under a budget the loss is chunked and the plan widens the chunk only as far as its peak
    allows (tests/test_fsdp.py's GPT and Llama are this size)."""
    assert not decide(64, 256, 64, 4).chunk
    assert decide(64, 256, 64, 4, planned=True).chunk
    model, inputs = seeded(HeadOnly, 256, 64), _ids(256, 2, 32)
    gm = fxopt.optimize(model, inputs, memory_budget="min", passes=["chunked_loss"])
    records = {r.name: r for r in gm.fxopt_report.passes}
    assert records["chunked_loss"].modified, records["chunked_loss"].stats
    assert records["checkpoint"].stats["loss_chunk_rows"] >= MIN_CHUNK_ROWS
    assert measure_train_step(gm, inputs).peak_bytes < measure_train_step(
        capture(model, inputs), inputs).peak_bytes
    assert fxopt.optimize(model, inputs, passes=["chunked_loss"]).fxopt_report.passes[0].stats[
        "rewritten"] == 0  # no budget: the automatic size, not worth it


@pytest.mark.parametrize("outputs", ["all", "loss"])
def test_fake_runs_sample_three_chunks_and_predict_the_whole_loops_peak(outputs):
    """A prediction runs chunks 0, 1 and the last of the loss's loops (chunks_sampled); the
    peak it predicts is the measured peak of the real loop over all of them."""
    from fxopt.analysis.estimate import estimate_train_peak
    from fxopt.runtime import chunked_loss as runtime

    model, inputs = seeded(HeadOnly, 512, 8), _ids(512, 2, 200)  # 400 tokens: 25 chunks of 16
    gm = capture(model, inputs)
    chunked_loss(gm, chunk_rows=MIN_CHUNK_ROWS, outputs=outputs, force=True)
    seen = []
    real_starts = runtime.chunk_starts

    def counted(rows, size):
        starts = real_starts(rows, size)
        seen.append(len(starts))
        return starts

    runtime.chunk_starts, restore = counted, real_starts
    try:
        predicted = estimate_train_peak(gm, inputs).bytes
        assert seen and max(seen) == 3  # sampled on fakes
        seen.clear()
        measured = measure_train_step(gm, inputs).peak_bytes
        assert seen and min(seen) == 25  # every chunk for real
    finally:
        runtime.chunk_starts = restore
    assert predicted == measured
