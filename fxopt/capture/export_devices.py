"""Devices that follow the module: the literal devices torch.export baked into a graph, replaced.

torch.export (2.14, non-strict) records a device as the literal it was at capture:
``torch.arange(T, device=x.device)`` becomes ``aten.arange.default(T, device=cpu)``,
``x.to(y.device)`` becomes ``aten.to.device(x, cpu, ...)``, and every ``aten.to`` comes with
an ``_assert_tensor_metadata(x, device=cpu)`` check. A module captured on ``cuda:0`` and moved to
``cuda:1`` (a deep copy per rank, ``.to(f"cuda:{rank}")``) would then make tensors on
``cuda:0`` and fail those checks, and an exported ``model.py`` loaded on another device would
fail at its first factory op.

``follow_devices(graph, ...)`` rewrites an unlifted export graph so that every such literal
follows the module when the graph runs:

- each argument (positional or keyword, anywhere in ``args``/``kwargs``) that is a
  ``torch.device`` equal to a device the graph's tensors were on at capture -- a parameter's, a
  buffer's or an input's -- becomes a ``tensor_device(t)`` node (``fxopt.runtime.devices``), ``t``
  a parameter or buffer on that device (the one whose qualified name shares the most of the
  node's module path, so a repeated block reads its own parameter and stays a block), else an
  input on it. The node goes just before its first user, with that user's module stack;
- inside the body of a grad-mode or autocast scope (a graph of its own, called with the
  scope's operands), ``t`` is one of the body's own inputs on that device; a body with none gets
  one more input, the caller's ``tensor_device`` node;
- a tensor constant fxopt lifted out of forward (``torch.tensor([...], device=x.device)``)
  that was on such a device is read through ``on_device(constant, tensor_device(t))``: the
  constant itself while the module stays where it was captured, a copy on the new device after
  a move.

When it is safe: always. At capture every ``tensor_device`` node returns the literal it replaces,
so the graph computes what it did; afterwards factory ops follow the parameters (or inputs) as
``x.device`` in the model's code did, and ``_assert_tensor_metadata`` checks what the model's
``.to`` calls promise about the device, against the module's device at call time.

Not handled: a device that no parameter, buffer or input was on at capture (a model that makes a
tensor on ``"cpu"`` by name in a CUDA model) stays literal, as written; so do the literals inside
the body of any other higher-order operator than the two scopes (none in the models fxopt is
tested on); a device *type* change (``cuda`` to ``cpu``) is let through by the input guard only
where ``device_types_built_in`` finds nothing else naming one (an autocast scope names its
device type): the guard is then portable (``fxopt.runtime.input_guard``). The
plain tensor attributes of the user's own modules are read as they are, as the model reads them
(``.to()`` does not move them either).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxopt.core import meta_keys
from fxopt.graph.graphs import graphs_of
from fxopt.runtime.devices import on_device, tensor_device
from fxopt.runtime.scoped import autocast_scope, grad_mode_scope

_HOP = torch.ops.higher_order
# Calls whose argument at this position is a body graph (a get_attr), called with the
# arguments after it.
_BODY_AT = {grad_mode_scope: 1, autocast_scope: 4}
for _name, _at in (("wrap_with_set_grad_enabled", 1), ("wrap_with_autocast", 4)):
    if hasattr(_HOP, _name):
        _BODY_AT[getattr(_HOP, _name)] = _at
_AUTOCAST = {autocast_scope, *([_HOP.wrap_with_autocast] if hasattr(_HOP, "wrap_with_autocast")
                                else [])}


@dataclass(frozen=True)
class _Ref:
    """A tensor the graph can read a device from: its node, its device at capture, and its
    qualified name (empty for an input)."""

    node: fx.Node
    device: torch.device
    name: str = ""


def follow_devices(graph: fx.Graph, owner: Mapping[str, Any], *, state: list[fx.Node],
                   inputs: list[tuple[fx.Node, torch.device]], constants: frozenset[str]) -> int:
    """Rewrite ``graph`` (see the module doc); returns how many literals now follow.

    ``owner``: ``get_attr`` target -> value for the graph's scoped bodies and constants;
    ``state``: the graph's ``get_attr`` nodes of parameters and buffers (with ``meta["val"]``);
    ``inputs``: tensor input nodes with their devices at capture; ``constants``: the ``get_attr``
    targets of the constants fxopt lifted (moved with ``on_device``).
    """
    refs = [_Ref(n, n.meta["val"].device, str(n.target)) for n in state
            if isinstance(n.meta.get("val"), torch.Tensor)]
    refs += [_Ref(n, device) for n, device in inputs]
    return _Rewriter(graph, refs, owner, constants, {}).run()


def literal_devices(graph: fx.Graph) -> list[tuple[fx.Node, torch.device]]:
    """Every (node, device) where a node of ``graph`` has a ``torch.device`` literal among its
    arguments (nested containers included)."""
    return [(node, device) for node in graph.nodes for device in literal_devices_of(node)]


def device_types_built_in(module: torch.nn.Module) -> list[tuple[str, str]]:
    """What still names a device type in the graphs of ``module`` (``graphs_of``: train, eval,
    region and scope bodies, kept blocks), as (device type, where) pairs: an autocast scope's
    device type, and every device literal ``follow_devices`` left (or a pass added). A graph
    with none computes the same operations on whatever device type its tensors are on."""
    found: list[tuple[str, str]] = []
    for graph_of in graphs_of(module):
        for node in graph_of.graph.nodes:
            where = f"{graph_of.where}: {node.name}"
            if node.target in _AUTOCAST and node.args and isinstance(node.args[0], str):
                found.append((node.args[0], f"the autocast scope in {where}"))
            found += [(d.type, f"the device literal {d} in {where}")
                      for d in literal_devices_of(node)]
    return found


class _Rewriter:
    """Rewrites one graph; ``fixed`` maps a device to a node that already is that device (a
    body's added input), ``done`` is shared with the rewriters of nested bodies."""

    def __init__(self, graph: fx.Graph, refs: list[_Ref], owner: Mapping[str, Any],
                 constants: frozenset[str], done: dict[int, list[torch.device]],
                 fixed: dict[torch.device, fx.Node] | None = None):
        self.graph = graph
        self.refs = refs
        self.fixed = dict(fixed or {})
        self.devices = {r.device for r in refs} | set(self.fixed)
        self.owner = owner
        self.constants = constants
        self.done = done  # id(body graph) -> the devices it takes as added inputs, in order
        self.readers: dict[tuple[fx.Node, str], fx.Node] = {}
        self.moved: dict[tuple[fx.Node, fx.Node], fx.Node] = {}  # (constant, reader) -> on_device
        self.count = 0

    def run(self) -> int:
        # in graph order, so that a node made before its first user comes before every later one
        for node in list(self.graph.nodes):
            if node.op in ("call_function", "call_method", "call_module", "output"):
                self._constants_read(node)
            if node.op in ("call_function", "call_method", "call_module"):
                self._literals(node)
                if node.op == "call_function" and node.target in _BODY_AT:
                    self._body(node, _BODY_AT[node.target])
        return self.count

    # -- what a node reads its device from

    def _ref(self, device: torch.device, path: str) -> _Ref | None:
        parts = path.split(".") if path else []

        def shared(ref: _Ref) -> int:
            if not ref.name:
                return -1  # an input: only when no parameter or buffer is on the device
            common = 0
            for a, b in zip(ref.name.split("."), parts):
                if a != b:
                    break
                common += 1
            return common

        candidates = [r for r in self.refs if r.device == device]
        return max(candidates, key=shared, default=None)  # max keeps the first of equals

    def _reader(self, device: torch.device, user: fx.Node) -> fx.Node | None:
        """The node ``user`` reads ``device`` from: a ``tensor_device`` node made before it
        (one per tensor read and module path), or the body input that is the device."""
        if device in self.fixed:
            return self.fixed[device]
        stack = meta_keys.module_stack(user)
        path = stack[-1][0] if stack else ""
        ref = self._ref(device, path)
        if ref is None:
            return None
        key = (ref.node, path)
        reader = self.readers.get(key)
        if reader is None:
            with self.graph.inserting_before(user):
                reader = self.graph.call_function(tensor_device, (ref.node,))
            reader.meta["val"] = device
            if meta_keys.NN_MODULE_STACK in user.meta:
                reader.meta[meta_keys.NN_MODULE_STACK] = dict(user.meta[meta_keys.NN_MODULE_STACK])
            self.readers[key] = reader
        return reader

    # -- the rewrites

    def _literals(self, node: fx.Node) -> None:
        readers: dict[torch.device, fx.Node] = {}
        for device in literal_devices_of(node):
            if device in self.devices and device not in readers:
                reader = self._reader(device, node)
                if reader is not None:
                    readers[device] = reader
        if not readers:
            return

        def replace(a: Any) -> Any:
            if isinstance(a, torch.device) and a in readers:
                self.count += 1
                return readers[a]
            return a

        node.args = fx.node.map_aggregate(node.args, replace)
        node.kwargs = fx.node.map_aggregate(node.kwargs, replace)

    def _constants_read(self, user: fx.Node) -> None:
        """Read each lifted constant ``user`` reads on a graph device through ``on_device``."""
        for node in user.all_input_nodes:
            if node.op != "get_attr" or node.target not in self.constants:
                continue
            value = node.meta.get("val", self.owner.get(node.target))
            device = value.device if isinstance(value, torch.Tensor) else None
            if device not in self.devices:
                continue
            reader = self._reader(device, user)
            if reader is None:
                continue
            key = (node, reader)
            moved = self.moved.get(key)
            if moved is None:
                with self.graph.inserting_before(user):
                    moved = self.graph.call_function(on_device, (node, reader))
                if meta_keys.NN_MODULE_STACK in reader.meta:
                    moved.meta[meta_keys.NN_MODULE_STACK] = dict(
                        reader.meta[meta_keys.NN_MODULE_STACK])
                if "val" in node.meta:
                    moved.meta["val"] = node.meta["val"]
                self.moved[key] = moved
                self.count += 1
            user.replace_input_with(node, moved)

    def _body(self, node: fx.Node, at: int) -> None:
        body_node = node.args[at] if len(node.args) > at else None
        if not isinstance(body_node, fx.Node) or body_node.op != "get_attr":
            return
        body = self.owner.get(body_node.target)
        graph = getattr(body, "graph", None)
        if not isinstance(graph, fx.Graph):
            return
        if id(graph) not in self.done:  # a body two calls share is rewritten once
            self.done[id(graph)] = self._rewrite_body(body, graph)
        readers = [self._reader(device, node) for device in self.done[id(graph)]]
        if readers:  # the body takes these devices as its last inputs
            node.args = (*node.args, *readers)

    def _rewrite_body(self, body: Any, graph: fx.Graph) -> list[torch.device]:
        """Rewrite a scope's body; returns the devices it now takes as added last inputs."""
        placeholders = list(graph.find_nodes(op="placeholder"))
        refs = [_Ref(p, p.meta["val"].device) for p in placeholders
                if isinstance(p.meta.get("val"), torch.Tensor)]
        needed = _literals_within(body, graph) & self.devices
        missing = sorted(needed - {r.device for r in refs}, key=str)
        added: dict[torch.device, fx.Node] = {}
        for device in missing:
            if placeholders:
                where = graph.inserting_after(placeholders[-1])
            else:
                where = graph.inserting_before(next(iter(graph.nodes)))
            with where:
                placeholders.append(graph.placeholder(f"fxopt_device_{len(added)}"))
            placeholders[-1].meta["val"] = device
            added[device] = placeholders[-1]
        inner = _Rewriter(graph, refs, _attributes_of(body), frozenset(), self.done, added)
        self.count += inner.run()
        graph.lint()
        if isinstance(body, fx.GraphModule):
            body.recompile()
        return list(added)


def _literals_within(body: Any, graph: fx.Graph) -> set[torch.device]:
    """The device literals of a body's graph and of the bodies nested in it."""
    found = {device for _, device in literal_devices(graph)}
    for child in _attributes_of(body).values():
        if isinstance(child, fx.GraphModule):
            found |= _literals_within(child, child.graph)
    return found


def _attributes_of(body: Any) -> dict[str, Any]:
    """A body's attributes by ``get_attr`` target: its nested bodies."""
    return dict(body.named_children()) if isinstance(body, torch.nn.Module) else {}


def literal_devices_of(node: fx.Node) -> list[torch.device]:
    """The ``torch.device`` literals among ``node``'s arguments, nested containers included."""
    found: list[torch.device] = []
    fx.node.map_aggregate((node.args, node.kwargs),
                          lambda a: found.append(a) if isinstance(a, torch.device) else None)
    return found
