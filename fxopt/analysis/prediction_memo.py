"""Each distinct prediction made once per ``optimize`` call: ``predictions_remembered``.

One ``fxopt.optimize`` call predicts the same step of the same module more than once:

- the report predicts the graph as captured, and the first pass that plans memory predicts it
  again as its starting point;
- a pass predicts the graph it leaves, and the next pass predicts that graph again;
- the checkpoint pass predicts its chosen plan on a copy of the graph, and the report then
  predicts the graph that plan was applied to.

Each prediction is a fake-tensor run of a whole training step (``fxopt.analysis.estimate``):
about 0.7 s for the 4-layer Llama of issue 36's CPU size, more on larger graphs, on a CPU or a
GPU alike, since fake tensors do no arithmetic. Its result depends only on what the module
computes, on the example inputs' metadata and on the training setup. Inside
``predictions_remembered()``, ``remembered`` keeps each result under a ``fingerprint`` of those,
and returns it when the same prediction is asked for again.

The fingerprint (``fxopt.core.fingerprint``) describes everything a fake run of the module
reads: its graphs up to the names of their values, every module's class, flags, hooks and
attributes, tensors by metadata and storage sharing, the inputs' metadata, the default dtype;
the training setup is part of the key. An object it can only name by its address is kept alive
by the memo, so no other object can take that address: such a module matches only itself, a
miss, never a false match. A module too large to describe cheaply is not remembered.

Safe because the scope is one ``optimize`` call: what a fake run reads besides the module and
the inputs (the leaf runs recorded at capture, the user's fused optimizer) does not change
inside it. Outside the scope nothing is remembered: ``fxopt.estimate_peak`` called by a user
always runs.

Not handled: a GraphModule whose graph was edited without ``recompile()`` runs code its graph
no longer describes. fxopt recompiles after every edit (``fxopt.rewrite.pass_base.graph_edited``
and the pipeline after each pass), so no such module reaches a prediction inside ``optimize``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from fxopt.core.fingerprint import described

T = TypeVar("T")

_MEMO: contextvars.ContextVar[_Memo | None] = contextvars.ContextVar("fxopt_prediction_memo",
                                                                     default=None)

@contextlib.contextmanager
def predictions_remembered() -> Iterator[PredictionCounts]:
    """Inside: ``remembered`` keeps each prediction and answers a repeat from memory. Yields
    the counts of predictions run and answered from memory, filled in as they are asked for."""
    memo = _Memo()
    token = _MEMO.set(memo)
    try:
        yield memo.counts
    finally:
        _MEMO.reset(token)


def remembered(what: str, module: nn.Module, inputs: Any, training: Hashable,
               predict: Callable[[], T], *, also_answers: tuple[str, ...] = ()) -> T:
    """``predict()``, or its result from earlier inside the same ``predictions_remembered``
    scope for an equal ``(what, fingerprint(module, inputs), training)``. A ``predict`` that
    raises is not remembered. ``also_answers``: the other ``what``s its result answers too (a
    prediction that finds out more than they ask)."""
    memo = _MEMO.get()
    if memo is None:
        return predict()
    try:
        description, pinned = described(module, inputs)
        key = (what, description, training)
        hash(key)
    except Exception:  # noqa: BLE001 - too large, or something it cannot describe or hash:
        key = None     # the prediction runs, and is not remembered
    if key is not None and key in memo.results:
        memo.counts.remembered += 1
        return memo.results[key]
    result = predict()
    memo.counts.run += 1
    if key is not None:
        for name in (what, *also_answers):
            memo.results[(name, *key[1:])] = result
        memo.pinned.extend(pinned)
    return result


@dataclass
class PredictionCounts:
    """Predictions asked for inside one ``predictions_remembered`` scope: ``run`` (fake-tensor
    runs made, remembered or not) and ``remembered`` (answered from memory)."""

    run: int = 0
    remembered: int = 0


class _Memo:
    """Predictions by key, and every object a key names by its address (``id``), kept alive
    while the memo is, so that no other object can take that address and match the key."""

    def __init__(self) -> None:
        self.results: dict[Hashable, Any] = {}
        self.pinned: list[Any] = []
        self.counts = PredictionCounts()
