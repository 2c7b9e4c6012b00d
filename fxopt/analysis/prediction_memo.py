"""Each distinct prediction made once per ``optimize`` call: ``predictions_remembered``.

One ``fxopt.optimize`` call predicts the same step of the same module more than once:

- the report predicts the graph as captured, and the first pass that plans memory predicts it
  again as its starting point;
- a pass predicts the graph it leaves, and the next pass predicts that graph again;
- the checkpoint pass predicts its chosen plan on a copy of the graph, and the report then
  predicts the graph that plan was applied to.

Each prediction is a fake-tensor run of a whole training step (``fxopt.analysis.estimate``):
about 0.7 s for the 4-layer Llama of issue 36's CPU size, more on larger graphs, on a CPU or a
GPU alike, since fake tensors do no arithmetic. Its result depends only on what the module
computes, on the example inputs' metadata and on the training setup. Inside
``predictions_remembered()``, ``remembered`` keeps each result under a ``fingerprint`` of those,
and returns it when the same prediction is asked for again.

The fingerprint describes everything a fake run of the module reads:

- every GraphModule's graph, which its code is generated from (the root's, its submodules', and
  the graphs held by plain attributes: a checkpointed region's body, forward and recompute graphs,
  an eval-mode graph): each node's op, target and arguments, with values by position, not by
  name (the checkpoint pass's copies name new nodes apart from the module it edits), and the
  code generator (the signature, a pytree's flattening, the dispatch on the training flag);
- every other module's class, training flag, hooks and attributes (a Dropout's ``p``);
- plain Python objects the module holds (a region's flags), walked through their attributes;
- tensors by metadata (shape, stride, dtype, device, ``requires_grad``) and by which of them are
  the same tensor or share a storage, never by value: a fake run reads no values;
- the example inputs' metadata and structure, the training setup, and the default dtype.

An object it cannot look into (no ``__dict__``, a function with a closure) is described by its
address, and the memo keeps it alive, so no other object can take that address: such a module
matches only itself, a miss, never a false match. A module too large to describe cheaply
(``MAX_ITEMS``) is not remembered.

Safe because the scope is one ``optimize`` call: what a fake run reads besides the module and
the inputs (the leaf runs recorded at capture, the user's fused optimizer) does not change
inside it. Outside the scope nothing is remembered: ``fxopt.estimate_peak`` called by a user
always runs.

Not handled: a GraphModule whose graph was edited without ``recompile()`` runs code its graph
no longer describes. fxopt recompiles after every edit (``fxopt.rewrite.pass_base.graph_edited``
and the pipeline after each pass), so no such module reaches a prediction inside ``optimize``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import fx, nn

from fxopt.core.names import qualified_name
from fxopt.core.tensors import storage_key
from fxopt.core.torch_private import (
    codegen_of,
    graph_module_attributes,
    graph_module_class_members,
)

T = TypeVar("T")

MAX_ITEMS = 100_000  # values described per fingerprint (a 4-layer Llama: 6,200, about 20 ms);
#                      beyond, the module is not remembered

_MEMO: contextvars.ContextVar[_Memo | None] = contextvars.ContextVar("fxopt_prediction_memo",
                                                                     default=None)

# Annotations on a GraphModule that do not decide what it computes: its analyses' and optimize's
# report.
_ANNOTATIONS = frozenset({"meta", "fxopt_report"})


@contextlib.contextmanager
def predictions_remembered() -> Iterator[PredictionCounts]:
    """Inside: ``remembered`` keeps each prediction and answers a repeat from memory. Yields
    the counts of predictions run and answered from memory, filled in as they are asked for."""
    memo = _Memo()
    token = _MEMO.set(memo)
    try:
        yield memo.counts
    finally:
        _MEMO.reset(token)


def remembered(what: str, module: nn.Module, inputs: Any, training: Hashable,
               predict: Callable[[], T]) -> T:
    """``predict()``, or its result from earlier inside the same ``predictions_remembered``
    scope for an equal ``(what, fingerprint(module, inputs), training)``. A ``predict`` that
    raises is not remembered."""
    memo = _MEMO.get()
    if memo is None:
        return predict()
    try:
        description, pinned = _described(module, inputs)
        key = (what, description, training)
        hash(key)
    except Exception:  # noqa: BLE001 - too large, or something it cannot describe or hash:
        key = None     # the prediction runs, and is not remembered
    if key is not None and key in memo.results:
        memo.counts.remembered += 1
        return memo.results[key]
    result = predict()
    memo.counts.run += 1
    if key is not None:
        memo.results[key] = result
        memo.pinned.extend(pinned)
    return result


@dataclass
class PredictionCounts:
    """Predictions asked for inside one ``predictions_remembered`` scope: ``run`` (fake-tensor
    runs made, remembered or not) and ``remembered`` (answered from memory)."""

    run: int = 0
    remembered: int = 0


class _Memo:
    """Predictions by key, and every object a key names by its address (``id``), kept alive
    while the memo is, so that no other object can take that address and match the key."""

    def __init__(self) -> None:
        self.results: dict[Hashable, Any] = {}
        self.pinned: list[Any] = []
        self.counts = PredictionCounts()


# Atoms that equal others of another type or value (True == 1, -0.0 == 0.0, nan != nan).
_TAGGED_ATOMS = frozenset({bool, float, complex, bytes})


class _TooLarge(Exception):
    pass


def fingerprint(module: nn.Module, inputs: Any) -> Hashable | None:
    """What a fake run of ``module`` on ``inputs`` depends on, as a hashable value (module
    docstring); None for a module too large to describe. An object described by its address is
    only told apart from objects alive at the same time."""
    try:
        return _described(module, inputs)[0]
    except _TooLarge:
        return None


def _described(module: nn.Module, inputs: Any) -> tuple[Hashable, list[Any]]:
    """The fingerprint, and the objects it names by their address."""
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
            raise _TooLarge
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
        members = graph_module_class_members(cls)
        return ("generated", tuple(self._named(b) for b in cls.__bases__),
                self._attributes(members))

    def _attributes(self, attributes: dict[str, Any]) -> Hashable:
        """An object's attributes by name (a copy may have set them in another order)."""
        return tuple((name, self.describe(attributes[name])) for name in sorted(attributes))

    def _named(self, value: Any) -> Hashable:
        """A function, class or module by the name it is importable under
        (``fxopt.core.names.qualified_name``); else by its address (a closure, a class made at
        run time), kept alive by the memo."""
        if isinstance(value, types.ModuleType):
            return ("python module", value.__name__)
        found = qualified_name(value)
        if found is not None:
            return ("named", *found)
        self.pinned.append(value)
        return ("identity", type(value).__name__, id(value))
