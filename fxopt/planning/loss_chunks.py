"""Whether to compute a token-level cross-entropy in chunks, and how many tokens per chunk.

The original loss keeps batch x sequence x vocab tensors through the start of backward (the saved
log-softmax, then its gradient and the logits' gradient: ``LOSS_TENSORS`` of them at once,
besides the logits a model returns). The chunked loss (``fxopt.runtime.chunked_loss``) keeps
instead, from the end of the forward on, the gradients for the hidden states (tokens x hidden)
and the head's weight (vocab x hidden), and holds ``CHUNK_TENSORS`` chunk x vocab temporaries
while a chunk is computed. ``decide`` rewrites when the first is larger than the second.

Chunk size. ``passes.chunked_loss`` leaves it open in the graph (``chunk_rows=None``) unless the
user fixed it: the call then takes ``auto_chunk_rows`` at run time, a size for speed that keeps
the chunk's temporaries small beside what chunking removes. Under a memory budget the checkpoint
pass sizes each open call as part of its plan: it plans with ``MIN_CHUNK_ROWS`` (the least the
loss can hold), then takes the widest chunk (``widest_chunk_rows``), up to the device's
``fast_chunk_rows``, whose predicted training peak stays within the budget (or, for ``"min"``,
within the plan's peak). The chunk's temporaries live only while the loss runs in the forward,
which is rarely where a least-memory plan peaks, and small chunks are slow: each chunk reads the
head's whole weight three times. Measured on CPU (one thread, the loss's forward and backward
alone, 1,024 tokens, hidden 256; ``benchmarks/results/loss_chunk_time_cpu.txt``): at vocab
151,936, 16 tokens per chunk take 1.32x the time of 256, and wider chunks were no faster. A GPU
wants fewer, larger matmuls: there the cap is ``FAST_CHUNK_ROWS_GPU`` (not yet measured on a
GPU; the budget bounds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxopt.runtime.chunked_loss import MIN_CHUNK_ROWS, floor_pow2, auto_chunk_rows

LOSS_TENSORS = 3          # vocab-sized tensors the original holds at the loss's backward
CHUNK_TENSORS = 2         # chunk x vocab temporaries alive while one chunk is computed
FAST_CHUNK_ROWS = 256     # wider chunks were no faster on CPU (module docstring)
FAST_CHUNK_ROWS_GPU = 2048


def fast_chunk_rows(device: torch.device) -> int:
    """The widest chunk worth its memory on ``device``'s type (module docstring)."""
    return FAST_CHUNK_ROWS if torch.device(device).type == "cpu" else FAST_CHUNK_ROWS_GPU


@dataclass(frozen=True)
class ChunkDecision:
    """``chunk`` False: leave the loss as it is, for ``reason``. ``chunk_rows``: the size the
    user fixed, or None (left open)."""

    chunk: bool
    chunk_rows: int | None
    reason: str | None
    removed_bytes: int       # the vocab-sized tensors the original holds at its loss's backward
    added_bytes: int         # what the chunked loss holds instead (gradients kept + chunk temps)


def widest_chunk_rows(rows: int, tokens: int, fits: Callable[[int], bool],
                      cap: int = FAST_CHUNK_ROWS) -> int:
    """The widest chunk, a power of two from ``rows`` up to ``cap`` (and no more than
    ``tokens``), for which ``fits(rows)`` holds; ``rows`` itself when no wider one does. The peak
    grows with the chunk, so ``fits`` is taken as monotone: the widest is tried first (the common
    case, one call), then a bisection."""
    widest = max(rows, min(cap, _ceil_pow2(tokens)))
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
    out, value = [], floor_pow2(max(1, low))
    while value <= high:
        out.append(value)
        value *= 2
    return out


def decide(tokens: int, vocab: int, hidden: int, itemsize: int, *,
           chunk_rows: int | str = "auto", force: bool = False,
           planned: bool = False) -> ChunkDecision:
    """Whether and how to chunk a loss over ``tokens`` rows of ``vocab`` logits computed from
    ``hidden``-wide states (``itemsize`` bytes per logit). ``chunk_rows="auto"``: the decision's
    ``chunk_rows`` is None (left open in the graph), and its bytes are counted at the size the
    open call will take: ``auto_chunk_rows`` at run time, or, ``planned`` (under a memory
    budget, where the checkpoint plan sizes it), ``MIN_CHUNK_ROWS`` and no more than the budget
    allows."""
    if chunk_rows != "auto":
        rows = max(1, min(int(chunk_rows), tokens))
        chosen: int | None = rows
    elif planned:
        rows, chosen = max(1, min(MIN_CHUNK_ROWS, tokens)), None
    else:
        rows, chosen = auto_chunk_rows(tokens, vocab, hidden, itemsize), None
    removed = LOSS_TENSORS * tokens * vocab * itemsize
    added = (vocab * hidden + tokens * hidden) * itemsize + CHUNK_TENSORS * rows * vocab * itemsize
    if force:
        return ChunkDecision(True, chosen, None, removed, added)
    if vocab <= hidden:
        return ChunkDecision(False, None, f"the projection does not widen (vocab {vocab} <= "
                             f"hidden {hidden}): its logits are no larger than its input",
                             removed, added)
    if removed <= added:
        return ChunkDecision(False, None, f"too few tokens ({tokens}) for the vocabulary "
                             f"({vocab}): the loss holds {removed} bytes of logits, the chunked "
                             f"loss would hold {added}", removed, added)
    return ChunkDecision(True, chosen, None, removed, added)
