"""Reading a captured graph: what every layer asks of a GraphModule without running it.

Capture stores each node's value on fake tensors in ``node.meta["val"]``
(``fxopt.graph.meta``); these helpers only read that.
"""

from __future__ import annotations

from torch import fx


def placeholder_values(gm: fx.GraphModule) -> tuple:
    """The example inputs as the graph last saw them: the placeholders' ``meta["val"]``."""
    return tuple(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
