"""Which graph values a node overwrites in place: one answer for every pass that moves or
recomputes nodes.

``overwritten_inputs(gm, node)`` lists the argument nodes whose storage ``node`` writes
(``overwritten_by_a_user(gm, value)``: whether some user of ``value`` writes it):

- a module called with ``inplace=True`` set on it (``nn.ReLU(inplace=True)``): its input;
- ``relu_``, ``x.add_(...)``, ``F.relu(x, inplace=True)``, ``x += y``, ``x[i] = v``: the first
  argument;
- ``F.batch_norm`` / ``F.instance_norm`` given running statistics: those buffers, which they
  update in training (``pad_channels`` writes BatchNorm this way, on padded copies); so does
  ``aten.batch_norm`` in torch.export's graphs, whose schema does not say so;
- an ATen operator (torch.export's graphs): every argument its schema marks as written
  (``Tensor(a!)``: ``aten.leaky_relu_``'s input, ``aten.copy_``'s destination).

- an opaque leaf recorded on a real run (``node.meta["fxopt_leaf"]``, ``fxopt.graph.leaf_tape``):
  the inputs whose version counter that run bumped.

Decided from the call alone (names and flags), not from a run, except for recorded leaves: an
in-place op whose name does not end in ``_`` and is not listed here is not seen. Other opaque
modules that mutate their inputs without an ``inplace`` attribute are not seen either; callers
that reorder treat every module they do not know as a side effect anyway.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxopt.core import meta_keys
from fxopt.core.torch_private import tree_leaves, written_arguments

INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.imatmul, operator.setitem})

# Norms that update the running statistics they are given, and where those arguments sit:
# F.batch_norm(input, running_mean, running_var, ...), but
# torch.batch_norm(input, weight, bias, running_mean, running_var, ...).
STATISTICS_UPDATERS = {torch.nn.functional.batch_norm: (1, 2),
                       torch.nn.functional.instance_norm: (1, 2),
                       torch.batch_norm: (3, 4), torch.instance_norm: (3, 4),
                       torch.ops.aten.batch_norm.default: (3, 4),
                       torch.ops.aten.instance_norm.default: (3, 4)}


def _trailing_underscore(name: object) -> bool:
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_")


def _recorded_writes(node: fx.Node) -> list[fx.Node]:
    """The argument nodes a recorded opaque leaf wrote in place on its real run (positions
    among its tensor arguments, in the order they are passed)."""
    record = node.meta.get(meta_keys.LEAF)
    positions = sorted({i for call in getattr(record, "calls", ()) for i in call.writes_inputs})
    if not positions:
        return []
    tensors = [a for a in tree_leaves((node.args, node.kwargs))
               if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    return [tensors[i] for i in positions if i < len(tensors)]


def overwritten_inputs(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The argument nodes whose values ``node`` overwrites in place (see the module doc)."""
    if node.op == "call_module" and _recorded_writes(node):
        return _recorded_writes(node)
    if node.op == "call_module":
        writes_first = getattr(gm.get_submodule(node.target), "inplace", False) is True
    elif node.op == "call_function" and node.target in STATISTICS_UPDATERS:
        positions = STATISTICS_UPDATERS[node.target]
        stats = [node.args[i] for i in positions if i < len(node.args)]
        stats += [node.kwargs.get("running_mean"), node.kwargs.get("running_var")]
        return [a for a in stats if isinstance(a, fx.Node)]
    elif node.op == "call_function" and written_arguments(node.target) is not None:
        written = [node.args[i] if i < len(node.args) else node.kwargs.get(name)
                   for i, name in written_arguments(node.target)]
        return [a for a in written if isinstance(a, fx.Node)]
    elif node.op == "call_function":
        writes_first = (node.target in INPLACE_OPERATORS or node.kwargs.get("inplace") is True
                        or _trailing_underscore(getattr(node.target, "__name__", "")))
    elif node.op == "call_method":
        writes_first = _trailing_underscore(node.target)
    else:
        return []
    first = node.args[0] if writes_first and node.args else None
    return [first] if isinstance(first, fx.Node) else []


def overwritten_by_a_user(gm: fx.GraphModule, value: fx.Node) -> bool:
    """Whether some node that takes ``value`` writes into it in place (views of it aside)."""
    return any(value in overwritten_inputs(gm, user) for user in value.users)
