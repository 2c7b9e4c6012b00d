"""What every pass returns, and the provenance mark passes put on the nodes they create.

A pass is ``def name(gm: fx.GraphModule, *, option: T = default, ...) -> PassResult``: it edits
``gm`` in place, and ``modified`` is exact (False means the graph is unchanged). New nodes carry
``meta["val"]`` and ``meta["fxopt_pass"]`` (provenance) -- ``mark_new`` does the latter.

``stats`` says what the pass decided: plain values (counts, bytes, reasons), and lists of
``StatsItem`` -- small frozen dataclasses a pass defines for what it did per site (a checkpointed
region, a padded op). The report prints each item by its own ``line()`` and writes it to JSON by
``as_dict()``, so nothing outside a pass reads its stats by key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult as _TorchPassResult

from fxopt.core import meta_keys
from fxopt.graph.meta import refresh_meta


class PassResult(_TorchPassResult):
    """torch.fx's ``PassResult(graph_module, modified)`` plus ``stats``: what the pass decided
    and why, for the report. It is a torch ``PassResult``, so fxopt passes also run under
    ``torch.fx.passes.infra.pass_manager.PassManager``."""

    stats: dict[str, Any]

    def __new__(cls, graph_module: fx.GraphModule, modified: bool,
                stats: dict[str, Any] | None = None) -> PassResult:
        result = super().__new__(cls, graph_module, modified)
        result.stats = dict(stats or {})
        return result

    def __repr__(self) -> str:
        return (f"PassResult(graph_module={type(self.graph_module).__name__}, "
                f"modified={self.modified}, stats={self.stats})")


class StatsItem:
    """One typed entry of a pass's stats (subclass it as a frozen dataclass): the pass owns its
    fields and how the report shows it."""

    def line(self) -> str:
        """One line of the optimize report, indented by the report."""
        raise NotImplementedError

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def stats_lines(stats: dict[str, Any]) -> list[str]:
    """The report lines of every ``StatsItem`` in ``stats``'s lists, in order."""
    return [item.line() for value in stats.values() if isinstance(value, (list, tuple))
            for item in value if isinstance(item, StatsItem)]


def plain_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with each ``StatsItem`` as its dict (what JSON output holds)."""
    def plain(value: Any) -> Any:
        if isinstance(value, StatsItem):
            return value.as_dict()
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return {key: plain(value) for key, value in stats.items()}


def mark_new(node: fx.Node, pass_name: str) -> fx.Node:
    """Record that ``pass_name`` created ``node``."""
    node.meta[meta_keys.PASS] = pass_name
    return node


def graph_edited(gm: fx.GraphModule) -> None:
    """What a pass does once it has edited ``gm``'s graph: check it (``Graph.lint``), regenerate
    ``gm``'s code, so the module runs the edit even when the pass is called on its own (outside
    ``fxopt.rewrite.pipeline``), and recompute every node's ``meta["val"]``, which later passes
    and the pipeline's lint read."""
    gm.graph.lint()
    gm.recompile()
    refresh_meta(gm)
