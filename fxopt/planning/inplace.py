"""Which activation call sites may overwrite their input: the decisions ``inplace_activations``
applies (the pass finds the in-place form of a call and edits the graph; this says whether it may).

``InplacePlanner(gm, train=...)`` gathers the facts once -- node order, alias classes
(``fxopt.analysis.alias_classes``), which nodes' backward saves which value
(``fxopt.analysis.saved_for_backward``), the calls of modules with hooks -- and answers
``why_not(node, source, form)``: None when ``node`` may overwrite ``source`` with the in-place
``form`` (target, constant arguments, keyword items), else the reason. After each rewrite the pass
calls ``rewritten(old, new, source)`` so the facts stay true for the next call sites.

A call site may overwrite its input when all of these hold (the pass's docstring lists them for
users):

- its input is computed inside the graph: not a graph input, parameter, buffer or constant, nor
  a view of one;
- neither its input nor any alias of it is the output of, or an argument to, a call of a module
  with hooks (a hook may keep what it sees; autograd refuses in-place writes to the outputs of a
  module with full backward hooks);
- no other node reads the input, or any alias of it, after this one;
- ``train=True``: no other node's backward needs the overwritten value, the in-place form's
  options are constants, and its own backward saves only its result
  (``inplace_backward_saves_only_result``, asked of autograd once per form).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from fxopt.analysis import alias_classes, saved_for_backward
from fxopt.core.graphs import placeholder_values
from fxopt.core.modules import has_hooks
from fxopt.core.tensors import storage_key
from fxopt.core.torch_private import tree_map_only

# (target, constant arguments after the input, sorted keyword items): one in-place form
InplaceForm = tuple[Any, tuple, tuple]


def inplace_backward_saves_only_result(target: Any, const_args: tuple, kwargs: tuple) -> bool:
    """Ask autograd: does the in-place form save only its (overwritten) input, and run backward?"""
    leaf = torch.linspace(-2.0, 2.0, 8, requires_grad=True)  # both signs; no RNG drawn
    x = leaf * 1.0
    saved_storages = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_storages.append(storage_key(t))
        return t.detach()  # never ``t`` itself: see fxopt.analysis.saved's module doc

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _call(target, (x, *const_args), dict(kwargs))
        out.sum().backward()
    except RuntimeError:
        return False
    return all(key == storage_key(x) for key in saved_storages)


def _call(target: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    if isinstance(target, operator.methodcaller):
        return target(args[0])
    return target(*args, **kwargs)


class InplacePlanner:
    """The facts about ``gm`` the in-place decisions need, kept true as the pass rewrites."""

    def __init__(self, gm: fx.GraphModule, *, train: bool):
        self.train = train
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.aliases = alias_classes(gm, either_mode=True)
        self.saved_by = _saved_by(gm) if train else {}
        self.hooked = {n for n in gm.graph.nodes
                       if n.op == "call_module" and has_hooks(gm.get_submodule(n.target))}
        self._backward_ok: dict[InplaceForm, bool] = {}  # per form, asked of autograd once

    def why_not(self, node: fx.Node, source: fx.Node, form: InplaceForm) -> str | None:
        """Why ``node`` may not overwrite ``source`` with ``form`` (None when it may)."""
        why = self._why_not_overwrite(node, source)
        if why is not None or not self.train:
            return why
        target, const_args, kwargs = form
        if any(isinstance(a, fx.Node) for a in (*const_args, *(v for _, v in kwargs))):
            return "its options are computed in the graph: autograd cannot be asked"
        if form not in self._backward_ok:
            self._backward_ok[form] = inplace_backward_saves_only_result(target, const_args,
                                                                         kwargs)
        if not self._backward_ok[form]:
            return "in-place backward would save a copy of the input (no memory saved)"
        return None

    def _why_not_overwrite(self, node: fx.Node, source: fx.Node) -> str | None:
        if source.op in ("placeholder", "get_attr"):
            return "input is a graph input or parameter"
        cls = self.aliases.get(source)
        group = ([n for n, c in self.aliases.items() if c == cls] if cls is not None
                 else [source])
        if any(n.op in ("placeholder", "get_attr") for n in group):
            return "input is a view of a graph input or parameter"
        for member in group:
            # A hook may keep the tensors it is given (feature extraction), and a full backward
            # hook's outputs may not be modified in place at all.
            module_call = member if member in self.hooked else next(
                (user for user in member.users if user in self.hooked), None)
            if module_call is not None:
                return f"input is seen by the hooks of {module_call.target}"
        for member in group:
            for user in member.users:
                if user is not node and self.order[user] > self.order[node]:
                    return f"input is used later by {user.name}"
        if self.train:
            for member in group:
                readers = self.saved_by.get(member, set()) - {node}
                if readers:
                    return f"backward of {sorted(r.name for r in readers)[0]} needs the input"
        return None

    def rewritten(self, old: fx.Node, new: fx.Node, source: fx.Node) -> None:
        """Keep the facts true after ``old`` became ``new``, which overwrites (aliases)
        ``source``."""
        order, aliases, saved_by = self.order, self.aliases, self.saved_by
        order[new] = order.pop(old)
        merged, was = aliases.setdefault(source, -1 - len(aliases)), aliases.pop(old, None)
        for member, cls in aliases.items():  # views of old's result are views of source's now
            if was is not None and cls == was:
                aliases[member] = merged
        aliases[new] = merged
        for readers in saved_by.values():
            if old in readers:
                readers.discard(old)
                readers.add(new)
        if old in saved_by:
            saved_by[new] = saved_by.pop(old)


def _saved_by(gm: fx.GraphModule) -> dict[fx.Node, set[fx.Node]]:
    """value node -> the nodes whose backward saves (an alias of) that value."""
    readers: dict[fx.Node, set[fx.Node]] = {}
    # The optimized module must also be right when its inputs require grad (it is a layer of a
    # bigger model, or the verifier asks for input gradients): ask autograd as if they did, which
    # saves a superset of what it saves for inputs that do not.
    inputs = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(
        t.is_floating_point() or t.is_complex()), placeholder_values(gm))
    for node, info in saved_for_backward(gm, inputs).items():
        for value in info.values:
            readers.setdefault(value, set()).add(node)
    return readers
