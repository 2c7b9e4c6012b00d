"""What a node of a graph depends on: the one walk over ``all_input_nodes`` the analyses share."""

from __future__ import annotations

from collections.abc import Callable

from torch import fx


def ancestors(node: fx.Node, stop: Callable[[fx.Node], bool] | None = None) -> set[fx.Node]:
    """``node`` and every node it reads, directly or through others; a node ``stop`` is true
    for is included, what it reads is not (unless read another way)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            if stop is None or not stop(current):
                stack.extend(current.all_input_nodes)
    return seen
