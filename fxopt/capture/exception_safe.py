"""Make every global-state change in a captured graph exception-safe (grad mode, autocast).

``exception_safe(graph)`` retargets torch.export's ``wrap_with_set_grad_enabled`` and
``wrap_with_autocast`` calls to ``fxopt.runtime.scoped``'s ``with``-block equivalents (same
arguments, same body), in ``graph`` and in the bodies it calls. A bare
``torch._C._set_grad_enabled`` call (which an error between it and its counterpart would leave
set) is refused: export's training IR has not produced one for any model fxopt captures.

RNG: checkpointed regions replay it through ``torch.utils.checkpoint``, which forks and restores
the generator state in ``with`` blocks; no captured graph sets a seed.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxopt.core.errors import TraceError
from fxopt.core.torch_private import BARE_SET_GRAD_ENABLED
from fxopt.runtime.scoped import autocast_scope, grad_mode_scope

_SCOPES = {
    torch.ops.higher_order.wrap_with_set_grad_enabled: grad_mode_scope,
    torch.ops.higher_order.wrap_with_autocast: autocast_scope,
}


def exception_safe(graph: fx.Graph, owner: torch.nn.Module, where: str) -> None:
    """Retarget the state-changing calls of ``graph`` (bodies read from ``owner``)."""
    for node in graph.find_nodes(op="call_function", target=BARE_SET_GRAD_ENABLED):
        raise TraceError(f"the captured graph sets grad mode bare at node {node.name}, which an "
                         "error inside the model would leave changed", where=where,
                         hint="report this model to fxopt; capture it with capture='fx' meanwhile")
    for node in list(graph.nodes):
        scope = _SCOPES.get(node.target) if node.op == "call_function" else None
        if scope is None:
            continue
        node.target = scope
        body_index = 1 if scope is grad_mode_scope else 4
        body = node.args[body_index]
        if isinstance(body, fx.Node) and body.op == "get_attr":
            inner = operator.attrgetter(body.target)(owner)
            if isinstance(inner, fx.GraphModule):
                exception_safe(inner.graph, inner, where)
                inner.recompile()
