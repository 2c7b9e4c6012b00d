"""Whether to compute a token-level cross-entropy in chunks, and how many tokens per chunk.

The original loss keeps batch x sequence x vocab tensors through the start of backward (the saved
log-softmax, then its gradient and the logits' gradient: ``LOSS_TENSORS`` of them at once,
besides the logits a model returns). The chunked loss (``fxopt.runtime.chunked_loss``) keeps
instead, from the end of the forward on, the gradients for the hidden states (tokens x hidden)
and the head's weight (vocab x hidden), and holds ``CHUNK_TENSORS`` chunk x vocab temporaries
while a chunk is computed. ``decide`` rewrites when the first is larger than the second.

Chunk size: large enough that each chunk's matmuls stay efficient, small enough that the chunk's
temporaries are a small part of what the rewrite removes. ``auto_chunk_rows`` takes the rows
whose chunk x vocab logits are as large as the larger of the hidden states (already alive at
that point, Liger's rule) and ``TARGET_CHUNK_BYTES``, as a power of two, at least
``MIN_CHUNK_ROWS``. Under the planner's ``memory_budget`` (``budget_chunk_rows``), a byte budget
takes the largest power of two whose temporaries take at most ``1 / BUDGET_SHARE`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxopt.planning.budget import parse_budget

LOSS_TENSORS = 3          # vocab-sized tensors the original holds at the loss's backward
CHUNK_TENSORS = 2         # chunk x vocab temporaries alive while one chunk is computed
TARGET_CHUNK_BYTES = 8 * 2**20
MIN_CHUNK_ROWS = 16
BUDGET_SHARE = 32         # a byte budget's part the chunk's temporaries may take: 1 / this


@dataclass(frozen=True)
class ChunkDecision:
    """``chunk_rows`` None: leave the loss as it is, for ``reason``."""

    chunk_rows: int | None
    reason: str | None
    removed_bytes: int       # the vocab-sized tensors the original holds at its loss's backward
    added_bytes: int         # what the chunked loss holds instead (gradients kept + chunk temps)


def _floor_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def auto_chunk_rows(tokens: int, vocab: int, hidden: int, itemsize: int,
                    chunk_budget_bytes: int | None = None) -> int:
    """Tokens per chunk (see the module docstring)."""
    row_bytes = max(1, vocab * itemsize * CHUNK_TENSORS)
    if chunk_budget_bytes is not None:
        rows = _floor_pow2(max(1, chunk_budget_bytes // row_bytes))
    else:
        target = max(tokens * hidden * itemsize, TARGET_CHUNK_BYTES)
        rows = max(MIN_CHUNK_ROWS, _floor_pow2(max(1, target // (vocab * itemsize))))
    return max(1, min(rows, tokens))


def budget_chunk_rows(budget: int | float | str, tokens: int, vocab: int, hidden: int,
                      itemsize: int) -> int:
    """Tokens per chunk under a memory budget (``fxopt.planning.budget``): bytes keep the chunk's
    temporaries within ``1 / BUDGET_SHARE`` of the budget (at least ``MIN_CHUNK_ROWS``, at most
    the default); ``"min"`` and a fraction of the activations take the default
    (``auto_chunk_rows``). Not the smallest chunks for ``"min"``: the temporaries live only while
    the loss runs in the forward, which was not where a least-memory plan peaked in our
    measurements (Llama, vocab 32,000: the same whole-step peak with 16 and 64 tokens per
    chunk), while each chunk reads the head's whole weight three times (16 tokens per chunk:
    about 20% more step time on CPU)."""
    kind, value = parse_budget(budget)
    default = auto_chunk_rows(tokens, vocab, hidden, itemsize)
    if kind == "bytes":
        fitting = auto_chunk_rows(tokens, vocab, hidden, itemsize,
                                  chunk_budget_bytes=int(value) // BUDGET_SHARE)
        return max(min(MIN_CHUNK_ROWS, tokens), min(fitting, default))
    return default


def decide(tokens: int, vocab: int, hidden: int, itemsize: int, *,
           chunk_rows: int | str = "auto", force: bool = False,
           budget: int | float | str | None = None) -> ChunkDecision:
    """Whether and how to chunk a loss over ``tokens`` rows of ``vocab`` logits computed from
    ``hidden``-wide states (``itemsize`` bytes per logit); ``chunk_rows="auto"`` takes them from
    ``budget`` when one is given."""
    if chunk_rows != "auto":
        rows = max(1, min(int(chunk_rows), tokens))
    elif budget is not None:
        rows = budget_chunk_rows(budget, tokens, vocab, hidden, itemsize)
    else:
        rows = auto_chunk_rows(tokens, vocab, hidden, itemsize)
    removed = LOSS_TENSORS * tokens * vocab * itemsize
    added = (vocab * hidden + tokens * hidden) * itemsize + CHUNK_TENSORS * rows * vocab * itemsize
    if force:
        return ChunkDecision(rows, None, removed, added)
    if vocab <= hidden:
        return ChunkDecision(None, f"the projection does not widen (vocab {vocab} <= hidden "
                             f"{hidden}): its logits are no larger than its input", removed,
                             added)
    if removed <= added:
        return ChunkDecision(None, f"too few tokens ({tokens}) for the vocabulary ({vocab}): the "
                             f"loss holds {removed} bytes of logits, the chunked loss would "
                             f"hold {added}", removed, added)
    return ChunkDecision(rows, None, removed, added)
