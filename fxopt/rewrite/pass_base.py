"""What every pass returns, and the provenance mark passes put on the nodes they create.

A pass is ``def name(gm: fx.GraphModule, *, option: T = default, ...) -> PassResult``: it edits
``gm`` in place, and ``modified`` is exact (False means the graph is unchanged). New nodes carry
``meta["val"]`` and ``meta["fxopt_pass"]`` (provenance) -- ``mark_new`` does the latter.
"""

from __future__ import annotations

from typing import Any

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult as _TorchPassResult


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


def mark_new(node: fx.Node, pass_name: str) -> fx.Node:
    """Record that ``pass_name`` created ``node``."""
    node.meta["fxopt_pass"] = pass_name
    return node
