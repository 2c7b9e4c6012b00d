"""The guard an export-captured module calls first: ``InputGuard``, and the recipes it matches.

``fxopt.capture.export_frontend`` captures a model for one example call. The graph it builds
starts with a ``guard_inputs(self._fxopt_input_guard, *arguments, state=(...))`` node: the
``InputGuard`` it reads, a plain attribute of the module, compares each call with what was
captured and raises before the graph computes anything:

- the parameters and buffers the graph reads (``state``, passed by the graph itself, so they are
  looked up through the module at call time): their dtypes, which torch.export builds into the
  graph (a ``.to(torch.float32)`` in forward is recorded as a cast to float32,
  ``_assert_tensor_metadata`` nodes check dtypes), so a module converted after capture
  (``.half()``, ``.to(torch.bfloat16)``, ``.double()``) is refused; and their device types.
  The devices export recorded follow the parameters, buffers and inputs when the graph runs
  (``fxopt.runtime.devices``), so a module moved from ``cuda:0`` to ``cuda:1`` computes on
  ``cuda:1``. A *portable* guard (no graph of the module names a device type:
  ``fxopt.capture.export_devices.device_types_built_in``) lets the whole module move to another
  device type too (``.to("cpu")`` of a GPU capture, an exported folder loaded with
  ``map_location="cpu"``), as torch.export's own ``move_to_device_pass`` moves a program: every
  tensor that was on one device type at capture must be on one device type now. Otherwise (an
  autocast scope names the capture's device type) another device type is refused;
- the arguments: containers and their keys, plain values built into the graph, tensor dtypes,
  device types (as above), ranks, fixed sizes, and the ranges and equalities of the sizes left
  dynamic;
- ``checks``: the conditions on sizes torch.export recorded while tracing (its guards: a branch on
  ``seq_len > 1``, two sizes whose product must match), as expressions (see ``evaluate``);
- ``autocast``: the autocast the graph was traced under, on the CPU and the capture's device
  types. torch.export records the casts autocast made as graph operations, and a cast that was
  a no-op (``hidden_states.to(torch.float32)`` in an RMSNorm, in full precision) as a check of
  the dtype, so under another autocast the graph computes another function or fails in its
  checks with torch's bare ``RuntimeError``: a call under another autocast is refused.

A *recipe* (``Leaf``, ``Const``, ``Seq``, ``Map``, ``Fields``) describes a nested Python value:
where its tensors are, and the containers and plain values around them; ``fxopt.capture.recipes``
builds and reads them.

A mismatch raises ``InputError`` (``fxopt.runtime.errors``, re-exported as
``fxopt.core.errors.InputError``). Under
symbolic tracing (an fx proxy among the arguments) the guard records itself as a graph node
instead, so optimizing a captured module keeps it. It checks inputs only, not what forward
does with them. The guard pickles with the module (``torch.save``), and ``fxopt.export`` writes
it as a constructor call (every field is a literal: ints, strings, dtypes, tuples, dicts). Not
handled: recipes naming classes defined inside a function (they neither pickle nor export); a
branch of forward's code on the device type (``if x.is_cuda:``), which torch.export follows
for the capture's device and leaves no trace of, so a portable module moved to another device
type keeps the capture's branch (the same function wherever the branch only picks a kernel).
Imports torch, the standard library and ``fxopt.runtime.errors`` (relatively, so an exported
folder's copies import each other) only (``tests/test_layers.py``), like all of ``fxopt.runtime``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from .errors import ConfigError, InputError

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
# Size expressions
#
# A condition torch.export recorded on the inputs' sizes, as nested tuples of literals (so it
# pickles and ``fxopt.export`` writes it as code): ``("size", leaf, dim)``,
# ``("stride", leaf, dim)`` and ``("offset", leaf)`` read the tensor with that ``Leaf`` index;
# ``(op, a, b)`` applies a binary operator of ``_BINARY``; ``("and", *xs)``, ``("or", *xs)``,
# ``("not", x)``, ``("neg", x)``, ``("min", *xs)``, ``("max", *xs)``, ``("abs", x)``;
# ``("unless", c, x)`` is ``c or x`` and ``("when", c, x)`` is ``not c or x`` (shown as ``x``,
# qualified); anything else is a constant (int, float, bool).

_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
           "//": operator.floordiv, "%": operator.mod, "**": operator.pow,
           "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
           ">": operator.gt, ">=": operator.ge}
_VARIADIC = {"and": all, "or": any, "min": min, "max": max}
_READS = ("size", "stride", "offset")
# How tightly each operator binds, as in Python: what ``render`` parenthesizes.
_PRECEDENCE = {"or": 1, "and": 2, "not": 3, "==": 4, "!=": 4, "<": 4, "<=": 4, ">": 4, ">=": 4,
               "+": 5, "-": 5, "*": 6, "/": 6, "//": 6, "%": 6, "neg": 7, "**": 8}


def evaluate(expr: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The value of ``expr`` for the tensors by ``Leaf`` index."""
    if not isinstance(expr, tuple):
        return expr
    head, *args = expr
    if head == "size":
        return tensors[args[0]].shape[args[1]]
    if head == "stride":
        return tensors[args[0]].stride(args[1])
    if head == "offset":
        return tensors[args[0]].storage_offset()
    if head in ("and", "or"):  # short-circuit, as Python's own
        return _VARIADIC[head](evaluate(a, tensors) for a in args)
    if head == "unless":
        return bool(evaluate(args[0], tensors)) or bool(evaluate(args[1], tensors))
    if head == "when":
        return not evaluate(args[0], tensors) or bool(evaluate(args[1], tensors))
    values = [evaluate(a, tensors) for a in args]
    if head in _VARIADIC:
        return _VARIADIC[head](values)
    if head == "not":
        return not values[0]
    if head == "neg":
        return -values[0]
    if head == "abs":
        return abs(values[0])
    return _BINARY[head](*values)


def core(expr: Any) -> Any:
    """``expr`` without its ``unless``/``when`` qualification: the condition it shows."""
    while isinstance(expr, tuple) and expr[0] in ("unless", "when"):
        expr = expr[2]
    return expr


def reads(expr: Any) -> list[tuple]:
    """The ``size``/``stride``/``offset`` reads in ``expr``, each once, in order."""
    if not isinstance(expr, tuple):
        return []
    if expr[0] in _READS:
        return [expr]
    found: list[tuple] = []
    for arg in expr[1:]:
        found += [r for r in reads(arg) if r not in found]
    return found


def render(expr: Any, names: dict[int, str], parent: int = 0) -> str:
    """``expr`` as Python text over the arguments' names (``input_ids.shape[1] != 1``)."""
    if not isinstance(expr, tuple):
        return repr(expr)
    head, *args = expr
    if head in _READS:
        name = names.get(args[0], f"tensor {args[0]}")
        return {"size": f"{name}.shape[{args[-1]}]", "stride": f"{name}.stride({args[-1]})",
                "offset": f"{name}.storage_offset()"}[head]
    if head in ("min", "max", "abs"):
        return f"{head}({', '.join(render(a, names) for a in args)})"
    if head == "unless":
        return f"{render(args[1], names, parent)} (unless {render(args[0], names)})"
    if head == "when":
        return f"{render(args[1], names, parent)} (when {render(args[0], names)})"
    level = _PRECEDENCE[head]
    if head == "not":
        text = f"not {render(args[0], names, level)}"
    elif head == "neg":
        text = f"-{render(args[0], names, level)}"
    else:  # left-associative: a right operand of the same precedence needs parentheses
        text = f" {head} ".join(render(a, names, level + (i > 0 and head not in ("and", "or")))
                                for i, a in enumerate(args))
    return f"({text})" if level < parent else text


# ---------------------------------------------------------------------------------------------
# The guard


@dataclass(frozen=True)
class TensorSpec:
    """One tensor input as captured."""

    dims: tuple  # int (fixed) or str (a symbol shared by every dim of that size)
    dtype: torch.dtype
    device_type: str


def captured_static(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds an ``InputGuard`` fixed at the example's sizes on request
    (``fxopt.optimize(dynamic=False)``): it serves no other batch size."""
    return any(isinstance(value, InputGuard) and value.static for value in vars(module).values())


def autocast_state(device_types: Any) -> tuple[tuple[str, torch.dtype | None], ...]:
    """(device type, the dtype autocast casts to there, None where it is off) for each of
    ``device_types``, in their order: what an export-captured module was traced under
    (``InputGuard.autocast``) and what a call runs under."""
    return tuple((t, _autocast_dtype(t)) for t in device_types)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


class InputGuard:
    """Raises ``InputError`` when a call's inputs differ from what the graph was captured for.

    Called by the graph with forward's arguments, in placeholder order, and ``state``: the
    parameters and buffers the graph reads. ``params`` is each argument's name and recipe;
    ``tensors`` the fixed dims (int) or symbols (str) of each tensor (by its ``Leaf`` index);
    ``ranges`` each symbol's (lowest, highest or None) size; ``checks`` pairs of a size
    expression that must be true and why (the module docstring); ``state`` the qualified name,
    dtype and device type of each tensor passed as ``state``, as captured; ``static``: every
    size was fixed on request (``fxopt.optimize(dynamic=False)``), which errors then say;
    ``portable``: no graph of the module names a device type, so the module may move to another
    one as a whole (the module docstring); ``autocast``: the autocast the graph was traced
    under, per device type (``autocast_state``), which a call must run under too.
    """

    __name__ = "fxopt_input_guard"
    checks: tuple = ()  # class defaults: a guard pickled before these fields existed
    state: tuple = ()
    static: bool = False
    portable: bool = False
    autocast: tuple = ()

    def __init__(self, model_name: str, params: tuple, tensors: tuple[TensorSpec, ...],
                 ranges: dict[str, tuple[int, int | None]], *, checks: tuple = (),
                 state: tuple = (), static: bool = False, portable: bool = False,
                 autocast: tuple = ()):
        self.model_name = model_name
        self.params = params
        self.tensors = tensors
        self.ranges = dict(ranges)
        self.checks = tuple(checks)
        self.state = tuple(state)
        self.static = static
        self.portable = portable
        self.autocast = tuple(autocast)

    def _key(self) -> tuple:
        return (self.model_name, self.params, self.tensors, tuple(sorted(self.ranges.items())),
                self.checks, self.state, self.static, self.portable, self.autocast)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputGuard) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"InputGuard({', '.join(name for name, _ in self.params)})"

    def __call__(self, *values: Any, state: tuple = ()) -> Any:
        proxy = next((v for v in (*values, *state) if isinstance(v, fx.Proxy)), None)
        if proxy is not None:
            # Symbolic tracing of the captured module (fxopt.optimize on it): stay in the graph.
            return proxy.tracer.create_proxy("call_function", self, values,
                                             {"state": state} if state else {})
        if self.autocast and autocast_state(t for t, _ in self.autocast) != self.autocast:
            self._refuse_autocast()
        moved: dict[str, str] = {}  # device type at capture -> the one in this call
        self._check_state(state, moved)
        found: dict[int, tuple[str, Any]] = {}
        for (name, recipe), value in zip(self.params, values):
            self._match(recipe, value, name, found)
        bound: dict[str, tuple[str, int]] = {}
        for index, spec in enumerate(self.tensors):
            self._check_tensor(spec, *found[index], bound, moved)
        if self.checks:
            self._check_sizes({i: t for i, (_, t) in found.items()},
                              {i: where for i, (where, _) in found.items()})

    def _refuse_autocast(self) -> None:
        def said(state: tuple) -> str:
            on = [f"{str(dtype).removeprefix('torch.')} autocast on {device_type}"
                  for device_type, dtype in state if dtype is not None]
            return "under " + " and ".join(on) if on else "in full precision"

        now = autocast_state(t for t, _ in self.autocast)
        captured = next((f'torch.autocast("{t}", dtype={d})' for t, d in self.autocast if d),
                        None)
        called = next((f'torch.autocast("{t}", dtype={d})' for t, d in now if d), None)
        how = (f"call fxopt.optimize inside the {called} you run it under "
               f"(with {called}: optimized = fxopt.optimize(model, ...))" if called else
               f"run it under the {captured} it was optimized in, or optimize the model outside "
               "autocast to run it in full precision")
        raise InputError(
            f"{self.model_name} was captured by torch.export {said(self.autocast)}, and this call "
            f"runs {said(now)}: torch.export builds the dtypes of the step it traced into the "
            "graph (the casts autocast made, and checks of the dtypes it found), so the module "
            "computes the model's function only under the autocast it was captured under",
            where=f"{self.model_name}.forward",
            hint=how + "; to run in both precisions, optimize once for each")

    def runs_on(self, device_type: str) -> bool:
        """Whether the module, moved as a whole to ``device_type``, passes this guard."""
        captured = {kind for _, _, kind in self.state} | {t.device_type for t in self.tensors}
        return self.portable or captured <= {device_type}

    def _device_type_kept(self, captured: str, now: str, moved: dict[str, str]) -> bool:
        """Whether a tensor that was on ``captured`` may be on ``now``: the same device type,
        or, in a portable graph, the one every tensor that was on ``captured`` is on now."""
        if not self.portable:
            return now == captured
        return moved.setdefault(captured, now) == now

    def _check_state(self, state: tuple, moved: dict[str, str]) -> None:
        if len(state) != len(self.state):  # a graph edited by hand; nothing to compare
            return
        for (name, dtype, device_type), t in zip(self.state, state):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(
                    f"{name} is {'None' if t is None else f'a {type(t).__name__}'} now, "
                    f"where fxopt.optimize saw a {dtype} "
                    f"tensor on {device_type}: the graph torch.export captured reads it as the "
                    "tensor it was (a parameter or buffer set to None, or to something else, "
                    "after capture)", where=f"{self.model_name} parameter or buffer {name}",
                    hint="make the change on your model, then optimize it; or give the module "
                         f"a tensor {name} again")
            if t.dtype == dtype and self._device_type_kept(device_type, t.device.type, moved):
                continue
            model = self.model_name
            if t.dtype == dtype and self.portable:  # moved in parts
                raise InputError(
                    f"{model}'s parameters and buffers were on {device_type} together at "
                    f"capture, and are now on {moved[device_type]} and {t.device.type}",
                    where=f"{model} parameter or buffer {name}",
                    hint="move the whole module to one device with .to(device)")
            if t.device.type != device_type and not self.portable:
                hint = (f"optimize the model on the device it runs on: move it with "
                        f".to({t.device.type!r}) first, then call fxopt.optimize on it (or move "
                        f"this module back to {device_type})")
            else:
                hint = (f"optimize the model in its training dtype: call fxopt.optimize on the "
                        f"model after .to({t.dtype}) (or convert this module back to {dtype}). "
                        "For mixed precision optimize and run it under torch.autocast; under "
                        "FSDP2 too, instead of a MixedPrecisionPolicy with a param_dtype, which "
                        "casts the parameters")
            raise InputError(
                f"{model} was captured by torch.export with {name} of dtype {dtype} on "
                f"{device_type}, and it is now {t.dtype} on {t.device.type} (the module was "
                "converted after capture, e.g. with .to(), .half(), .double()); the captured "
                "graph has the capture dtypes built in (forward's casts such as "
                ".to(torch.float32) are recorded as they ran), so it cannot compute in another "
                "dtype" + ("" if self.portable else "; it names the capture's device type too "
                           "(an autocast scope or a device literal), so it cannot run on another "
                           "device type"),
                where=f"{model} parameter or buffer {name}", hint=hint)

    def _check_sizes(self, tensors: dict[int, torch.Tensor], names: dict[int, str]) -> None:
        for expr, why in self.checks:
            if evaluate(expr, tensors):
                continue
            shown = reads(core(expr)) or reads(expr)
            got = ", ".join(f"{render(r, names)} = {evaluate(r, tensors)}" for r in shown)
            where = render(shown[0], names) if shown else "sizes"
            raise InputError(
                f"{self.model_name} was captured by torch.export for calls where "
                f"{render(expr, names)} ({why}); this call gives {got}", where=
                f"{self.model_name}.forward argument {where}",
                hint="calls where this does not hold take another path through forward's "
                     "code: capture again (fxopt.optimize) with example inputs of these sizes, "
                     "or pad the inputs to sizes the captured module serves")

    def _fail(self, what: str, where: str, hint: str) -> None:
        raise InputError(f"{self.model_name} was captured by torch.export {what}",
                         where=f"{self.model_name}.forward argument {where}", hint=hint)

    def _match(self, recipe: Any, value: Any, where: str, found: dict) -> None:
        recapture = optimize_again_with(where.split(".")[0].split("[")[0])
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
                      bound: dict[str, tuple[str, int]], moved: dict[str, str]) -> None:
        recapture = ("capture again with an example of the size you will call it with: "
                     "sizes stay dynamic only where the model does not fix them")
        if t.dtype != spec.dtype or not self._device_type_kept(spec.device_type, t.device.type,
                                                              moved):
            on = moved.get(spec.device_type, spec.device_type)
            self._fail(f"with {where} of dtype {spec.dtype} on {on}"
                       + (" (where the module is)" if on != spec.device_type else "")
                       + f"; this call gives {t.dtype} on {t.device.type}", where,
                       "convert the input, or capture again with inputs of this dtype and device")
        if t.dim() != len(spec.dims):
            self._fail(f"with {where} of {len(spec.dims)} dimensions; this call gives "
                       f"{t.dim()}", where, recapture)
        for d, (want, size) in enumerate(zip(spec.dims, t.shape)):
            here = f"{where}.shape[{d}]"
            if isinstance(want, int):
                if size != want and self.static:
                    self._fail(f"for {here} == {want} only (it was captured with dynamic=False: "
                               f"every size is the example's); this call gives {size}", here,
                               "call it with the example's sizes, or optimize the model again "
                               "without dynamic=False (CLI: without --static-shapes) to serve "
                               "other sizes")
                if size != want:
                    self._fail(f"for {here} == {want} only (this size cannot be dynamic: the "
                               "model's code fixes it, so the graph has it built in); this call "
                               f"gives {size}", here, recapture)
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
                why = ""
                if size < low and size < 2:
                    why = (" (torch.export traces sizes 0 and 1 apart from larger ones: a batch "
                           "of 1 is served only when a second trace at batch 1 gave the same "
                           "graph, and no other dimension serves 0 or 1)")
                self._fail(f"for {here} in {span}{why}; this call gives {size}", here,
                           "capture again with example inputs of this size (fxopt.optimize on "
                           "the model with them), or pad the inputs to a size in the range")


def optimize_again_with(argument: str) -> str:
    """What to do when a call passes ``argument`` otherwise than the example inputs did."""
    return (f"optimize the model again with {argument} in its example inputs as this call passes "
            f"it: fxopt.optimize(model, args, example_kwargs={{..., {argument!r}: ...}}). For a "
            "Hugging Face model, pass a batch as your data collator makes it (input_ids, "
            "attention_mask, labels): an optimized module serves the arguments it was optimized "
            "with")


def _same_plain(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def describe(value: Any) -> str:
    return repr(value) if type(value) in PLAIN else f"a {type(value).__name__}"


def guard_inputs(guard: InputGuard, *values: Any, state: tuple = ()) -> None:
    """What the captured graph calls first: ``guard(*values, state=state)``. A function, so the
    graph's code names it by import (``torch.save`` and ``fxopt.export`` need that), with the
    guard object and the state it checks read from the module when the graph runs."""
    guard(*values, state=state)


torch.fx.node.has_side_effect(guard_inputs)  # dead-code elimination must keep it
