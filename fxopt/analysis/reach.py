"""What a node of a graph depends on: the one walk over ``all_input_nodes`` the analyses share."""

from __future__ import annotations

from torch import fx


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it reads, directly or through others."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen
