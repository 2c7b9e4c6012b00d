"""Whether to compute a token-level cross-entropy in chunks, and how many tokens per chunk.

The original loss keeps batch x sequence x vocab tensors through the start of backward (the saved
log-softmax, then its gradient and the logits' gradient: ``LOSS_TENSORS`` of them at once,
besides the logits a model returns). The chunked loss (``fxopt.runtime.chunked_loss``) keeps
instead, from the end of the forward on, the gradients for the hidden states (tokens x hidden)
and the head's weight (vocab x hidden), and holds ``CHUNK_TENSORS`` chunk x vocab temporaries
while a chunk is computed. ``decide`` rewrites when the first is larger than the second.

Chunk size. Without a memory budget, ``auto_chunk_rows``: large enough that each chunk's matmuls
stay efficient, small enough that the chunk's temporaries are a small part of what the rewrite
removes: the rows whose chunk x vocab logits are as large as the larger of the hidden states
(already alive at that point, Liger's rule) and ``TARGET_CHUNK_BYTES``, as a power of two, at
least ``MIN_CHUNK_ROWS``. Under a memory budget, memory first, then time: the loss is rewritten
with the smallest chunk (``MIN_CHUNK_ROWS``) so the checkpoint planner plans around the least
the loss can hold; once the plan is made, ``widest_chunk_rows`` takes the widest chunk, up to
``FAST_CHUNK_ROWS``, whose predicted training peak is no higher (``passes.loss_chunk_size``).
The chunk's temporaries live only while the loss runs in the forward, which is rarely where a
least-memory plan peaks, and small chunks are slow: each chunk reads the head's whole weight
three times. Measured on CPU (one thread, the loss's forward and backward alone, 1,024 tokens,
hidden 256; ``benchmarks/results/loss_chunk_time_cpu.txt``): at vocab 151,936, 16 tokens per
chunk take 1.32x the time of 256.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

LOSS_TENSORS = 3          # vocab-sized tensors the original holds at the loss's backward
CHUNK_TENSORS = 2         # chunk x vocab temporaries alive while one chunk is computed
TARGET_CHUNK_BYTES = 8 * 2**20
MIN_CHUNK_ROWS = 16
FAST_CHUNK_ROWS = 256     # wider chunks were no faster on CPU (module docstring)


@dataclass(frozen=True)
class ChunkDecision:
    """``chunk_rows`` None: leave the loss as it is, for ``reason``."""

    chunk_rows: int | None
    reason: str | None
    removed_bytes: int       # the vocab-sized tensors the original holds at its loss's backward
    added_bytes: int         # what the chunked loss holds instead (gradients kept + chunk temps)


def _floor_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def auto_chunk_rows(tokens: int, vocab: int, hidden: int, itemsize: int) -> int:
    """Tokens per chunk without a memory budget (module docstring)."""
    target = max(tokens * hidden * itemsize, TARGET_CHUNK_BYTES)
    rows = max(MIN_CHUNK_ROWS, _floor_pow2(max(1, target // (vocab * itemsize))))
    return max(1, min(rows, tokens))


def widest_chunk_rows(rows: int, tokens: int, fits: Callable[[int], bool]) -> int:
    """The widest chunk, a power of two from ``rows`` up to ``FAST_CHUNK_ROWS`` (and no more than
    ``tokens``), for which ``fits(rows)`` holds; ``rows`` itself when no wider one does. The peak
    grows with the chunk, so ``fits`` is taken as monotone: the widest is tried first (the common
    case, one call), then a bisection."""
    widest = max(rows, min(FAST_CHUNK_ROWS, _ceil_pow2(tokens)))
    candidates = [r for r in _powers_of_two(rows, widest) if r > rows]
    if not candidates:
        return rows
    if fits(candidates[-1]):
        return min(candidates[-1], tokens)
    low, high = -1, len(candidates) - 1  # candidates[high] does not fit
    while high - low > 1:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            low = middle
        else:
            high = middle
    return rows if low < 0 else candidates[low]


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _powers_of_two(low: int, high: int) -> list[int]:
    out, value = [], _floor_pow2(max(1, low))
    while value <= high:
        out.append(value)
        value *= 2
    return out


def decide(tokens: int, vocab: int, hidden: int, itemsize: int, *,
           chunk_rows: int | str = "auto", force: bool = False,
           budget: int | float | str | None = None) -> ChunkDecision:
    """Whether and how to chunk a loss over ``tokens`` rows of ``vocab`` logits computed from
    ``hidden``-wide states (``itemsize`` bytes per logit); ``chunk_rows="auto"`` takes
    ``MIN_CHUNK_ROWS`` when a ``budget`` is given (module docstring)."""
    if chunk_rows != "auto":
        rows = max(1, min(int(chunk_rows), tokens))
    elif budget is not None:
        rows = min(MIN_CHUNK_ROWS, tokens)  # widened after planning (widest_chunk_rows)
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
