"""The guard an export-captured module calls first: ``InputGuard``, and the recipes it matches.

``fxopt.capture.export_frontend`` captures a model for one example call. The graph it builds
starts with a ``guard_inputs(self._fxopt_input_guard, *arguments)`` node: the ``InputGuard``
it reads, a plain attribute of the module, compares each call's arguments with what was captured
(containers and their keys, plain values built into the graph, tensor dtypes, device types,
ranks, fixed sizes, and the ranges and equalities of the sizes left dynamic) and raises before
the graph computes something else. A *recipe* (``Leaf``, ``Const``, ``Seq``, ``Map``,
``Fields``) describes a nested Python value: where its tensors are, and the containers and
plain values around them; ``fxopt.capture.recipes`` builds and reads them.

A mismatch raises the error class the guard was given (fxopt gives
``fxopt.core.errors.InputError``, which this module may not import: see the last line). Under
symbolic tracing (an fx proxy among the arguments) the guard records itself as a graph node
instead, so optimizing a captured module keeps it. It checks inputs only, not what forward
does with them. The guard pickles with the module (``torch.save``), and ``fxopt.export`` writes
it as a constructor call. Not handled: recipes naming classes defined inside a function (they
neither pickle nor export). Imports torch and the standard library only (``tests/test_layers.py``), like all of
``fxopt.runtime``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

PLAIN = (type(None), bool, int, float, str)  # values a recipe holds as they are (``Const``)


# ---------------------------------------------------------------------------------------------
# Recipes


@dataclass(frozen=True)
class Leaf:
    """A tensor (or, in an output recipe, a SymInt)."""

    index: int  # position among the flat tensors given to (or returned by) the export


@dataclass(frozen=True)
class Const:
    """A plain value (one of ``PLAIN``), held as it is."""

    value: Any


@dataclass(frozen=True)
class Seq:
    """A tuple, list or namedtuple (``cls``) of ``items``."""

    cls: type
    items: tuple


@dataclass(frozen=True)
class Map:
    """A dict or Mapping subclass (``cls``), ``keys`` in order, ``items`` their values."""

    cls: type
    keys: tuple
    items: tuple


@dataclass(frozen=True)
class Fields:
    """A dataclass instance (``cls``): ``names`` of its fields, ``items`` their values."""

    cls: type
    names: tuple
    items: tuple


# ---------------------------------------------------------------------------------------------
# The guard


@dataclass(frozen=True)
class TensorSpec:
    """One tensor input as captured."""

    dims: tuple  # int (fixed) or str (a symbol shared by every dim of that size)
    dtype: torch.dtype
    device_type: str


class InputGuard:
    """Raises ``error`` when a call's inputs differ from what the graph was captured for.

    Called by the graph with forward's arguments, in placeholder order. ``params`` is each
    argument's name and recipe; ``tensors`` the fixed dims (int) or symbols (str) of each tensor
    (by its ``Leaf`` index); ``ranges`` each symbol's (lowest, highest or None) size. ``error``
    is called as ``error(what, where=..., hint=...)`` (``fxopt.core.errors.InputError``).
    """

    __name__ = "fxopt_input_guard"

    def __init__(self, model_name: str, params: tuple, tensors: tuple[TensorSpec, ...],
                 ranges: dict[str, tuple[int, int | None]], *, error: type[Exception]):
        self.model_name = model_name
        self.params = params
        self.tensors = tensors
        self.ranges = dict(ranges)
        self.error = error

    def _key(self) -> tuple:
        return (self.model_name, self.params, self.tensors, tuple(sorted(self.ranges.items())),
                self.error)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputGuard) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"InputGuard({', '.join(name for name, _ in self.params)})"

    def __call__(self, *values: Any) -> Any:
        proxy = next((v for v in values if isinstance(v, fx.Proxy)), None)
        if proxy is not None:
            # Symbolic tracing of the captured module (fxopt.optimize on it): stay in the graph.
            return proxy.tracer.create_proxy("call_function", self, values, {})
        found: dict[int, tuple[str, Any]] = {}
        for (name, recipe), value in zip(self.params, values):
            self._match(recipe, value, name, found)
        bound: dict[str, tuple[str, int]] = {}
        for index, spec in enumerate(self.tensors):
            self._check_tensor(spec, *found[index], bound)

    def _fail(self, what: str, where: str, hint: str) -> None:
        raise self.error(f"{self.model_name} was captured by torch.export {what}",
                         where=f"{self.model_name}.forward argument {where}", hint=hint)

    def _match(self, recipe: Any, value: Any, where: str, found: dict) -> None:
        recapture = ("capture again with example inputs like this call "
                     "(fxopt.capture.export_frontend.capture_with_export(model, args, kwargs))")
        if isinstance(recipe, Leaf):
            if not isinstance(value, torch.Tensor):
                self._fail(f"with {where} a tensor; this call gives {describe(value)}",
                           where, recapture)
            found[recipe.index] = (where, value)
            return
        if isinstance(recipe, Const):
            if type(value) is not type(recipe.value) or not _same_plain(value, recipe.value):
                self._fail(f"with {where}={recipe.value!r}, which the graph has built in; this "
                           f"call gives {describe(value)}", where, recapture)
            return
        if type(value) is not recipe.cls:
            self._fail(f"with {where} a {recipe.cls.__name__}; this call gives "
                       f"{describe(value)}", where, recapture)
        if isinstance(recipe, Fields):
            for name, item in zip(recipe.names, recipe.items):
                self._match(item, getattr(value, name), f"{where}.{name}", found)
        elif isinstance(recipe, Map):
            if set(value) != set(recipe.keys):
                self._fail(f"with {where} holding keys {list(recipe.keys)}; this call gives "
                           f"{list(value)}", where, recapture)
            for key, item in zip(recipe.keys, recipe.items):
                self._match(item, value[key], f"{where}[{key!r}]", found)
        else:
            if len(value) != len(recipe.items):
                self._fail(f"with {where} holding {len(recipe.items)} items; this call gives "
                           f"{len(value)}", where, recapture)
            for i, item in enumerate(recipe.items):
                self._match(item, value[i], f"{where}[{i}]", found)

    def _check_tensor(self, spec: TensorSpec, where: str, t: torch.Tensor,
                      bound: dict[str, tuple[str, int]]) -> None:
        recapture = ("capture again with an example of the size you will call it with; only "
                     "dimension 0 can stay dynamic, and only when the model does not fix it")
        if t.dtype != spec.dtype or t.device.type != spec.device_type:
            self._fail(f"with {where} of dtype {spec.dtype} on {spec.device_type}; this call "
                       f"gives {t.dtype} on {t.device.type}", where,
                       "convert the input, or capture again with inputs of this dtype and device")
        if t.dim() != len(spec.dims):
            self._fail(f"with {where} of {len(spec.dims)} dimensions; this call gives "
                       f"{t.dim()}", where, recapture)
        for d, (want, size) in enumerate(zip(spec.dims, t.shape)):
            here = f"{where}.shape[{d}]"
            if isinstance(want, int):
                if size != want:
                    self._fail(f"for {here} == {want} only (the graph has this size built in); "
                               f"this call gives {size}", here, recapture)
                continue
            if want in bound and bound[want][1] != size:
                first, first_size = bound[want]
                self._fail(f"assuming {here} == {first}; this call gives {size} and "
                           f"{first_size}", here, "pass inputs whose sizes agree as they did "
                           "in the example inputs")
            bound.setdefault(want, (here, size))
            low, high = self.ranges.get(want, (0, None))
            if size < low or (high is not None and size > high):
                span = f"[{low}, {'inf' if high is None else high}]"
                self._fail(f"for {here} in {span}; this call gives {size}", here,
                           f"{recapture}. Sizes 0 and 1 are always fixed by torch.export, so "
                           "capture with a batch of at least 2 to call with any batch of 2 or more")


def _same_plain(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def describe(value: Any) -> str:
    return repr(value) if type(value) in PLAIN else f"a {type(value).__name__}"


def guard_inputs(guard: InputGuard, *values: Any) -> None:
    """What the captured graph calls first: ``guard(*values)``. A function, so the graph's code
    names it by import (``torch.save`` and ``fxopt.export`` need that), with the guard object
    itself read from the module."""
    guard(*values)


torch.fx.node.has_side_effect(guard_inputs)  # dead-code elimination must keep it
