"""What a module computes on given inputs, as a hashable value: ``fingerprint(module, inputs)``.

Two modules with equal fingerprints run the same code on the same kind of tensors: equal
fingerprints, equal fake-tensor runs, equal captures. The description covers:

- every GraphModule's graph, which its code is generated from (the root's, its submodules', and
  the graphs held by plain attributes: a checkpointed region's body, forward and recompute graphs,
  an eval-mode graph): each node's op, target and arguments, with values by position, not by
  name (the checkpoint pass's copies name new nodes apart from the module it edits), and the
  code generator (the signature, a pytree's flattening, the dispatch on the training flag);
- every other module's class, training flag, hooks and attributes (a Dropout's ``p``, a Hugging
  Face model's config);
- plain Python objects the module holds (a region's flags), walked through their attributes;
- tensors by metadata (shape, stride, dtype, device, ``requires_grad``) and by which of them are
  the same tensor or share a storage, never by value;
- the inputs' metadata and structure, and the default dtype.

Functions and classes are described by the name they are importable under. An object it cannot
look into (no ``__dict__``, a function with a closure, a class made at run time) is described by
its address: ``described`` returns those objects, and whoever keeps the fingerprint keeps them
alive, so no other object can take that address and match. A module with more than
``MAX_ITEMS`` values is not described (``TooLarge``).

Not covered: tensor values, the code of a class or function behind its name (a method
monkeypatched onto a class keeps the class's name), and global state a forward reads.

Used by ``fxopt.analysis.prediction_memo`` (a prediction asked for twice in one ``optimize``
call) and ``fxopt.capture.reuse`` (a capture reused only for the model it was made of, unchanged).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Hashable
from typing import Any

import torch
from torch import fx, nn

from fxopt.core.names import qualified_name
from fxopt.core.tensors import storage_key
from fxopt.core.torch_private import (
    codegen_of,
    graph_module_attributes,
    graph_module_class_members,
    per_instance_classes,
)

MAX_ITEMS = 100_000  # values described per fingerprint (a 4-layer Llama: 6,200, about 20 ms)

# Annotations on a GraphModule that do not decide what it computes: its analyses' and optimize's
# report.
_ANNOTATIONS = frozenset({"meta", "fxopt_report"})


# Atoms that equal others of another type or value (True == 1, -0.0 == 0.0, nan != nan).
_TAGGED_ATOMS = frozenset({bool, float, complex, bytes})


class TooLarge(Exception):
    """More than ``MAX_ITEMS`` values to describe."""


def fingerprint(module: nn.Module, inputs: Any) -> Hashable | None:
    """What a fake run of ``module`` on ``inputs`` depends on, as a hashable value (module
    docstring); None for a module too large to describe. An object described by its address is
    only told apart from objects alive at the same time."""
    try:
        return described(module, inputs)[0]
    except TooLarge:
        return None


def described(module: nn.Module, inputs: Any) -> tuple[Hashable, list[Any]]:
    """The fingerprint, and the objects it names by their address (keep them alive for as long
    as the fingerprint is compared). Raises ``TooLarge``."""
    describer = _Describer()
    return describer.describe((module, inputs, torch.get_default_dtype())), describer.pinned


class _Describer:
    """Describes a value as nested tuples; objects seen before become a reference to the order
    they were first seen in, so sharing is part of the description and cycles end."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.storages: dict[int, int] = {}
        self.items = 0
        self.keep: list[Any] = []  # what ``seen`` holds ids of stays alive while describing
        self.pinned: list[Any] = []  # what is described by its address
        self.targets: dict[int, Hashable] = {}  # what graph nodes call, described once each

    def describe(self, value: Any) -> Hashable:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise TooLarge
        cls = type(value)
        if cls is int or cls is str or value is None:  # the most frequent: bare, no tuple
            return value
        if cls in _TAGGED_ATOMS:  # True == 1, -0.0 == 0.0: told apart by type and repr
            return (cls.__name__, repr(value))
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return ("torch", repr(value))
        if isinstance(value, torch.Size):
            return ("size", tuple(str(s) for s in value))
        if id(value) in self.seen:
            return ("ref", self.seen[id(value)])
        self.seen[id(value)] = len(self.seen)
        self.keep.append(value)
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, fx.GraphModule):
            return self._graph_module(value)
        if isinstance(value, nn.Module):
            return ("module", self._named(type(value)), self._attributes(vars(value)))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(self.describe(v) for v in value))
        if isinstance(value, dict):
            return (type(value).__name__,
                    tuple((self.describe(k), self.describe(v)) for k, v in value.items()))
        if isinstance(value, (set, frozenset)):
            return (type(value).__name__, tuple(sorted(repr(self.describe(v)) for v in value)))
        if isinstance(value, functools.partial):
            return ("partial", self.describe(value.func), self.describe(value.args),
                    self.describe(value.keywords))
        if isinstance(value, types.MethodType):
            return ("method", self.describe(value.__func__), self.describe(value.__self__))
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type,
                              types.ModuleType)) or not hasattr(value, "__dict__"):
            return self._named(value)
        return ("object", self._named(type(value)), self._attributes(vars(value)))

    def _tensor(self, t: torch.Tensor) -> Hashable:
        try:
            storage = storage_key(t)
            offset = t.storage_offset()
            stride = tuple(str(s) for s in t.stride())
        except (RuntimeError, NotImplementedError):  # no storage (sparse, ...)
            storage, offset, stride = id(t), 0, ()
        shared = self.storages.setdefault(storage, len(self.storages))
        return ("tensor", type(t).__name__, tuple(str(s) for s in t.shape), stride, str(offset),
                repr(t.dtype), str(t.device), t.requires_grad, isinstance(t, nn.Parameter),
                shared)

    def _graph_module(self, gm: fx.GraphModule) -> Hashable:
        attributes = {k: v for k, v in graph_module_attributes(gm).items()
                      if k not in _ANNOTATIONS}
        return ("graph module", self._graph_module_class(type(gm)), self._graph(gm.graph),
                self._attributes(attributes))

    def _graph(self, graph: fx.Graph) -> Hashable:
        """A graph as its code is generated from it, up to the names of its values: each node's
        op, target and arguments, a node argument by its position, and the code generator
        (the signature, a pytree's flattening, a dispatch on the training flag). The
        checkpoint pass's copies and the module it edits name new nodes differently."""
        position = {node: i for i, node in enumerate(graph.nodes)}

        def argument(value: Any) -> Hashable:
            if type(value) is int or type(value) is str or value is None:
                return value
            if isinstance(value, fx.Node):
                return ("node", position[value])
            if isinstance(value, (list, tuple)):
                return (type(value).__name__, tuple(argument(v) for v in value))
            if isinstance(value, dict):
                return ("dict", tuple((k, argument(v)) for k, v in value.items()))
            if isinstance(value, slice):
                return ("slice", argument(value.start), argument(value.stop),
                        argument(value.step))
            return self.describe(value)

        nodes = tuple((n.op, self._target(n.target), argument(n.args), argument(n.kwargs),
                       n.name if n.op == "placeholder" else "") for n in graph.nodes)
        return ("graph", nodes, self.describe(codegen_of(graph)))

    def _target(self, target: Any) -> Hashable:
        """What a node calls: an attribute path, or a function or operator by its importable
        name (else its address); an object called (a region) is described like any other."""
        if isinstance(target, str):
            return ("path", target)
        if id(target) in self.targets:
            return self.targets[id(target)]
        if isinstance(target, (types.FunctionType, types.BuiltinFunctionType)) or (
                type(target).__module__ or "").startswith("torch."):
            described = self._named(target)
        else:
            described = self.describe(target)
        self.targets[id(target)] = described
        self.keep.append(target)
        return described

    def _graph_module_class(self, cls: type) -> Hashable:
        """fx makes a class per GraphModule to hold its generated forward: described by the
        classes it derives from and the members fx did not put there (``forward`` is the
        module's code, described apart), not by its identity."""
        if "forward" not in vars(cls):
            return self._named(cls)
        if id(cls) in self.seen:
            return ("ref", self.seen[id(cls)])
        self.seen[id(cls)] = len(self.seen)
        # A copy's class derives from the first class that is no per-instance one
        # (GraphModule.__new__): the per-instance classes of the MRO count as one.
        generated = per_instance_classes(cls)
        members: dict[str, Any] = {}
        for own in reversed(generated):
            members.update(graph_module_class_members(own))
        return ("generated", tuple(self._named(b) for b in cls.__mro__ if b not in generated),
                self._attributes(members))

    def _attributes(self, attributes: dict[str, Any]) -> Hashable:
        """An object's attributes by name (a copy may have set them in another order)."""
        return tuple((name, self.describe(attributes[name])) for name in sorted(attributes))

    def _named(self, value: Any) -> Hashable:
        """A function, class or module by the name it is importable under
        (``fxopt.core.names.qualified_name``); else by its address (a closure, a class made at
        run time), kept alive by whoever keeps the fingerprint."""
        if isinstance(value, types.ModuleType):
            return ("python module", value.__name__)
        found = qualified_name(value)
        if found is not None:
            return ("named", *found)
        self.pinned.append(value)
        return ("identity", type(value).__name__, id(value))
