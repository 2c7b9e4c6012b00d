"""The chunked-loss calls of a graph whose chunk size is left open, and setting their size.

``passes.chunked_loss`` with ``chunk_rows="auto"`` leaves the size open in the graph
(``chunk_rows=None``: ``auto_chunk_rows`` at run time). Under a memory budget the size is part
of the plan: ``passes.checkpoint`` plans with the smallest chunk and widens it within the
budget, and ``passes.chunked_loss`` predicts its own saving at that smallest chunk. Both edit the
calls through ``LossChunks``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from fxopt.planning.loss_chunks import MIN_CHUNK_ROWS, widest_chunk_rows
from fxopt.runtime.chunked_loss import chunked_loss, chunked_loss_and_logits

SIZED_LOSS_CALLS = (chunked_loss, chunked_loss_and_logits)


class LossChunks:
    """The chunked-loss calls of a graph whose chunk size is left open (``chunk_rows=None``,
    ``passes.chunked_loss`` with ``chunk_rows="auto"``): the plan sizes them. A size the user
    fixed is an int, and stays."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.calls = [n for n in gm.graph.nodes if n.op == "call_function"
                      and n.target in SIZED_LOSS_CALLS and n.kwargs.get("chunk_rows") is None]
        values = [c.args[0].meta.get("val") for c in self.calls if isinstance(c.args[0], fx.Node)]
        self.tokens = max((int(v.shape[:-1].numel()) for v in values if v is not None), default=0)

    def __bool__(self) -> bool:
        return bool(self.calls)

    def set(self, rows: int | None) -> None:
        for call in self.calls:
            call.kwargs = {**call.kwargs, "chunk_rows": rows}
        if self.calls:
            self.gm.recompile()

    def widest(self, fits: Callable[[], bool], cap: int) -> int:
        """Set every call to the widest chunk (``widest_chunk_rows``, at most ``cap`` tokens)
        for which ``fits()`` holds with the calls at that size; returns it."""
        def fits_at(rows: int) -> bool:
            self.set(rows)
            return fits()
        rows = widest_chunk_rows(MIN_CHUNK_ROWS, self.tokens, fits_at, cap)
        self.set(min(rows, max(self.tokens, 1)))
        return min(rows, max(self.tokens, 1))
