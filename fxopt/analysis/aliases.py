"""Which graph values share a storage, decided from the fake tensors in ``node.meta["val"]``.

``alias_classes(gm)`` gives every non-output node a class id; nodes whose values may share a
storage (views, in-place results, ``getitem`` of a tuple output, split/chunk pieces) get the same
id. A node whose value holds several storages (a leaf module returning ``(out, (h, c))``) joins
all of them into one class: classes are *may-alias* groups, which is the safe side for a pass
that overwrites or reorders.

The decision comes from storage identity of the fake tensors, so it is exact for every op the
fake run saw, leaf modules included. A node without ``meta["val"]`` (added by a pass that did not
refresh meta) falls back to a small table of view and in-place ops; anything not in the table is
assumed to own a fresh storage.

Not handled: aliasing through values hidden in Python objects (lists stored on modules) and
between meta of different fake runs (refresh meta after a rewrite).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxopt.core.tensors import storage_key, tensors_in

_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "flatten",
    "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select", "split",
    "chunk", "unbind", "contiguous", "detach", "as_strided", "movedim", "swapaxes", "diagonal",
    "unfold", "__getitem__",
})
_VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.flatten, torch.reshape, torch.transpose, torch.t, torch.permute,
    torch.squeeze, torch.unsqueeze, torch.narrow, torch.select, torch.split, torch.chunk,
    torch.unbind, torch.detach, torch.movedim, torch.swapaxes, torch.diagonal,
    operator.iadd, operator.isub, operator.imul, operator.itruediv,
})
_VIEW_MODULES = (torch.nn.Flatten, torch.nn.Identity, torch.nn.Unflatten)


def _table_alias_source(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """For a node without ``val``: the input it views or overwrites, by the op table."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place = isinstance(name, str) and name.endswith("_") and not name.startswith("_")
    if node.op == "call_method" and (node.target in _VIEW_METHODS or in_place):
        return node.args[0]
    if node.op == "call_function" and (
            node.target in _VIEW_FUNCTIONS or in_place or node.kwargs.get("inplace") is True):
        return node.args[0]
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, _VIEW_MODULES) or getattr(module, "inplace", False) is True:
            return node.args[0]
    return None


_DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def _identity_in_eval(gm: fx.GraphModule, node: fx.Node) -> bool:
    return (node.op == "call_module" and bool(node.args) and isinstance(node.args[0], fx.Node)
            and isinstance(gm.get_submodule(node.target), _DROPOUT_MODULES))


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def find(self, node: fx.Node) -> fx.Node:
        self.parent.setdefault(node, node)
        while self.parent[node] is not node:
            self.parent[node] = self.parent[self.parent[node]]
            node = self.parent[node]
        return node

    def union(self, a: fx.Node, b: fx.Node) -> None:
        self.parent[self.find(b)] = self.find(a)


def alias_classes(gm: fx.GraphModule, *, either_mode: bool = False) -> dict[fx.Node, int]:
    """node -> alias class id (0, 1, 2, ... numbered by each class's first node in graph order).

    The fake run is a train-mode run. ``either_mode=True`` adds the aliases eval mode makes: a
    dropout module returns its input itself there. Passes that overwrite or move writes need
    it, since the optimized module runs in eval mode too; memory accounting (train) does not.
    """
    groups = _UnionFind()
    owner: dict[int, fx.Node] = {}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for node in nodes:
        groups.find(node)
        if either_mode and _identity_in_eval(gm, node):
            groups.union(node.args[0], node)
        if "val" not in node.meta:
            source = _table_alias_source(gm, node)
            if source is not None:
                groups.union(source, node)
            continue
        for t in tensors_in(node.meta["val"]):
            key = storage_key(t)
            if key in owner:
                groups.union(owner[key], node)
            else:
                owner[key] = node
    ids: dict[fx.Node, int] = {}
    classes: dict[fx.Node, int] = {}
    for node in nodes:
        classes[node] = ids.setdefault(groups.find(node), len(ids))
    return classes


def last_use(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """node -> the node after which FX's generated code drops it (its last user in graph order).

    Nodes without users map to themselves (the generated code drops them right away). Values
    returned by the graph map to the output node. Aliases are not considered: a view keeps its
    base's storage alive beyond the base's own last use.
    """
    last: dict[fx.Node, fx.Node] = {}
    for node in reversed(gm.graph.nodes):
        for used in node.all_input_nodes:
            last.setdefault(used, node)
    return {node: last.get(node, node) for node in gm.graph.nodes if node.op != "output"}
