"""What every pass returns, and the small helpers passes share.

A pass is ``def name(gm: fx.GraphModule, *, option: T = default, ...) -> PassResult``: it edits
``gm`` in place, and ``modified`` is exact (False means the graph is unchanged). New nodes carry
``meta["val"]`` and ``meta["fxopt_pass"]`` (provenance) -- ``mark_new`` does the latter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)


def mark_new(node: fx.Node, pass_name: str) -> fx.Node:
    """Record that ``pass_name`` created ``node``."""
    node.meta["fxopt_pass"] = pass_name
    return node
