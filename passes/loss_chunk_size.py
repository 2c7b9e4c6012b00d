"""Widen the chunked loss's chunks as far as the predicted training peak allows.

``passes.chunked_loss`` under a memory budget writes its calls with the smallest chunk
(``fxopt.planning.loss_chunks.MIN_CHUNK_ROWS`` tokens), so the checkpoint planner plans around the
least the loss can hold. Small chunks are slow: each reads the head's whole weight three times
(at vocab 151,936 on CPU, 16 tokens per chunk take 1.32x the time of 256). Run after the plan is
made, this pass gives each such call the widest chunk, up to ``FAST_CHUNK_ROWS`` tokens, whose
predicted training peak (``fxopt.analysis.estimate``, a fake-tensor run of forward and backward
of the whole rewritten module, with the fused optimizer step and per-block sharding when they
are planned for) is no higher than the peak with the chunks it was given: the chunk's
temporaries live only while the loss runs in the forward, so where the plan peaks elsewhere they
are free. It never raises the predicted peak, and changes only the ``chunk_rows`` of the calls.

``fxopt.optimize`` runs it after ``checkpoint`` whenever ``chunked_loss`` runs under a
``memory_budget``. It widens only calls whose chunk size the pass chose (``chunk_rows="auto"``,
``fxopt.core.meta_keys.CHUNK_ROWS``); a chunk size the user gave is left as given. Calls inside
checkpointed regions are widened like the others. Several calls get one chunk size together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx

from fxopt.analysis.blocks import block_parameter_names
from fxopt.analysis.estimate import estimate_train_peak
from fxopt.core import meta_keys
from fxopt.core.graphs import placeholder_values
from fxopt.planning.loss_chunks import widest_chunk_rows
from fxopt.rewrite.pass_base import PassResult, StatsItem
from fxopt.runtime.chunked_loss import chunked_loss, chunked_loss_and_logits
from fxopt.runtime.fused_step import FusedOptimizers

PASS_NAME = "loss_chunk_size"
_CALLS = (chunked_loss, chunked_loss_and_logits)


@dataclass(frozen=True)
class WidenedCall(StatsItem):
    """One chunked-loss call, in the pass's ``stats["calls"]``."""

    call: str
    tokens: int
    chunk_rows_before: int
    chunk_rows: int

    def line(self) -> str:
        return (f"{self.call}: {self.chunk_rows_before} -> {self.chunk_rows} tokens per chunk "
                f"(of {self.tokens})")


def tunable_calls(gm: fx.GraphModule) -> list[tuple[fx.GraphModule, fx.Node]]:
    """The chunked-loss calls of ``gm`` and of the GraphModules under it (checkpointed regions)
    whose chunk size ``passes.chunked_loss`` chose."""
    found = []
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            found += [(module, node) for node in module.graph.nodes
                      if node.op == "call_function" and node.target in _CALLS
                      and node.meta.get(meta_keys.CHUNK_ROWS) == "auto"]
    return found


def _tokens(node: fx.Node) -> int:
    hidden = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return int(hidden.shape[:-1].numel()) if hidden is not None else 0


def _set_rows(calls: list[tuple[fx.GraphModule, fx.Node]], rows: list[int]) -> None:
    for (_, node), value in zip(calls, rows):
        node.kwargs = {**node.kwargs, "chunk_rows": value}
    for module in {id(m): m for m, _ in calls}.values():
        module.recompile()


def loss_chunk_size(gm: fx.GraphModule, *, fused_optimizer: FusedOptimizers = None,
                    shard_blocks: bool = False) -> PassResult:
    """Give each chunked-loss call the widest chunk that does not raise the predicted training
    peak (module docstring)."""
    calls = tunable_calls(gm)
    if not calls:
        return PassResult(gm, False, {"reason": "no chunked-loss call with a chosen chunk size"})
    released = block_parameter_names(gm, gm.graph) if shard_blocks else frozenset()
    inputs = placeholder_values(gm)

    def predict() -> int:
        return estimate_train_peak(gm, inputs, fused_optimizer=fused_optimizer,
                                   released_gradients=released).bytes

    given = [int(node.kwargs["chunk_rows"]) for _, node in calls]
    tokens = max(_tokens(node) for _, node in calls)
    peak = predict()
    predictions = 1
    smallest = min(given)

    def fits(rows: int) -> bool:
        nonlocal predictions
        _set_rows(calls, [max(g, rows) for g in given])
        predictions += 1
        return predict() <= peak

    rows = widest_chunk_rows(smallest, tokens, fits)
    chosen = [max(g, min(rows, _tokens(node) or rows)) for g, (_, node) in zip(given, calls)]
    _set_rows(calls, chosen)
    stats: dict[str, Any] = {
        "predicted_peak_bytes": peak, "predictions": predictions,
        "calls": [WidenedCall(node.name, _tokens(node), g, c)
                  for (_, node), g, c in zip(calls, given, chosen)]}
    return PassResult(gm, chosen != given, stats)
