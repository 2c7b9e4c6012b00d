"""Capture a model with ``torch.export`` instead of symbolic tracing: ``capture_with_export``.

Symbolic tracing (``fxopt.capture.trace``) stops at a root ``forward`` it cannot follow: Hugging
Face models wrap ``forward`` in ``*args, **kwargs`` decorators, and a hand-written GPT builds
``torch.tril(torch.ones(T, T))`` with ``T`` read off ``x.shape``. ``torch.export`` (non-strict)
runs ``forward`` as ordinary Python on fake tensors, so both are captured, down to ATen operators.

``capture_with_export(model, args, kwargs)`` returns a plain ``torch.fx.GraphModule`` that, like
``trace``'s result:

- holds the user's own Parameter and buffer objects under the same qualified names, in a module
  tree that is a structural copy of the model's (``fxopt.core.modules.structural_copy``), so
  ``state_dict()`` keys, order and shapes are the model's, and an optimizer over either trains
  both; tensor constants the graph reads are plain attributes, not state;
- is called like the model: the same positional arguments, the same keyword names, and returns
  the same types (tuples, lists, dicts, ``OrderedDict`` subclasses, namedtuples, dataclasses such as
  Hugging Face's ``ModelOutput``, rebuilt by the graph itself: no pytree registration needed). The
  model is called during export exactly as the example call was written (positional arguments
  positionally, keyword arguments by keyword), since a decorator may tell them apart;
- has one graph per training mode: the model is exported with every module in train mode and
  again in eval mode; when the graphs differ the module dispatches on ``self.training``
  (``fxopt.capture.train_eval``), so ``.train()`` / ``.eval()`` switch dropout and BatchNorm;
- carries ``meta["val"]`` on every node (``fxopt.capture.meta.propagate_meta``) and
  ``meta["fxopt_trace"]`` (a ``TraceInfo``: no leaves, ``mode_dependent``) and
  ``meta["fxopt_export"]`` (an ``ExportInfo``: which input sizes stayed dynamic).

The graph is torch.export's training IR (``torch.export.export`` traces pre-dispatch on torch
2.14; there is no separate public ``export_for_training``): ATen operators above autograd, such
as ``aten.linear``, ``aten.dropout(x, p, train)``, ``aten.scaled_dot_product_attention``,
``aten.batch_norm`` updating the running statistics in place. Run eagerly, autograd
differentiates it as it does the model, and dropout draws from the global RNG as the model does.

Input sizes: dimension 0 of every tensor input is exported as ``Dim.AUTO`` (dynamic unless the
model fixes it; a size of 0 or 1 is always fixed); every other dimension, dtype, device type,
plain argument value (``None``, flags) and container structure is fixed. If export fails with a
dynamic batch it is repeated with static sizes. The graph starts with a guard node (an
``InputGuard`` call) that raises ``InputError`` when a call does not match what was captured (a
different sequence length, a batch size outside the captured range, two batch sizes that must be
equal and are not, ``labels=None`` when it was captured with labels), instead of computing
something else. Arguments after the last one the example gives are not parameters of the
captured module (passing one is Python's ``TypeError``): the model used its own default, which a
decorator may set differently from what the signature says. An argument skipped before a given
one stays in its place at its default, and the guard refuses any other value.

Safe when: forward's tensor computation does not depend on tensor *values* (``if x.sum() > 0``
fails with ``TraceError``; ``fxopt.capture.trace`` keeps such code as an opaque leaf instead), and
forward's Python side effects are in-place updates of parameters and buffers (a forward that
*assigns* a buffer, ``self.count = self.count + 1``, is refused: torch.export drops that update for
every module but the exported root). The user's model is never modified: training flags,
parameters, buffers, gradients, plain attributes (export itself restores the plain attributes of
every module it traced from copies, which is one reason it runs on a structural copy) and the
RNG state are as before.

Not handled (``TraceError`` unless said otherwise): modules with hooks (export would run them once,
at capture time); forward signatures without names for the inputs given (a bare ``*args,
**kwargs`` with no ``functools.wraps``); example inputs other than tensors, plain values and
containers of them; output containers other than those listed; sizes whose exported relation is
an expression (``y.shape[0] == 2 * x.shape[0]``: re-exported with static sizes, see
``ExportInfo.static_reason``). Not detected: submodules left in another training mode than the
root on purpose (a frozen BatchNorm): the train graph has every module in train mode and the eval
graph every module in eval mode, and a submodule's own flag is never read again. Not supported:
``torch.save(module)`` and ``fxopt.export`` folders (the guard node is an object, not importable
code), and inputs of another dtype (so ``fxopt.verify``'s float64 re-check of rounding
differences cannot run on the captured module: it reports why in the mismatch). The graph's operators are ATen operators, not the module calls and ``torch.nn.functional``
calls fxopt's passes were written for: see ``tests/test_export_frontend.py`` for which passes
apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import operator
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from fxopt.capture.meta import propagate_meta
from fxopt.capture.trace import TraceInfo, graph_module_like
from fxopt.capture.trace_checks import user_frame
from fxopt.capture.train_eval import install_eval_graph, same_graph
from fxopt.core.errors import FxoptError, InputError, TraceError
from fxopt.core.modules import call_hooks, structural_copy
from fxopt.core.state import preserved_state
from fxopt.core.torch_private import codegen_of

_PLAIN = (type(None), bool, int, float, str)
_ATTRIBUTE_PREFIX = "_fxopt_export_"
_INNER = "inner"  # the model's attribute name inside the exported wrapper


@dataclass(frozen=True)
class ExportInfo:
    """How the model was exported: ``dynamic`` names the input sizes left free (e.g.
    ``input_ids.shape[0]``); ``static_reason`` says why export fell back to static sizes."""

    dynamic: tuple[str, ...] = ()
    static_reason: str | None = None


# ---------------------------------------------------------------------------------------------
# Values as recipes: where the tensors are, and how to rebuild the containers around them


@dataclass(frozen=True)
class _Leaf:
    index: int  # position among the flat tensors given to (or returned by) the export


@dataclass(frozen=True)
class _Const:
    value: Any


@dataclass(frozen=True)
class _Seq:
    cls: type
    items: tuple


@dataclass(frozen=True)
class _Map:
    cls: type
    keys: tuple
    items: tuple


@dataclass(frozen=True)
class _Fields:
    cls: type
    names: tuple
    items: tuple


class _Unsupported(Exception):
    def __init__(self, where: str, kind: str):
        super().__init__(f"{where} is a {kind}")
        self.where = where
        self.kind = kind


def _flatten(value: Any, leaves: list, where: str, *, symbolic: bool = False) -> Any:
    """The recipe of ``value``; its tensors (and, with ``symbolic``, SymInts) go to ``leaves``."""
    if isinstance(value, torch.Tensor) or (
            symbolic and isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))):
        leaves.append(value)
        return _Leaf(len(leaves) - 1)
    if type(value) in _PLAIN:
        return _Const(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        if not all(f.init for f in fields):
            raise _Unsupported(where, f"dataclass {type(value).__name__} with init=False fields")
        return _Fields(type(value), tuple(f.name for f in fields), tuple(
            _flatten(getattr(value, f.name), leaves, f"{where}.{f.name}", symbolic=symbolic)
            for f in fields))
    if isinstance(value, Mapping):
        keys = tuple(value)
        if not all(type(k) in (str, int) for k in keys):
            raise _Unsupported(where, f"{type(value).__name__} with keys other than str and int")
        return _Map(type(value), keys, tuple(
            _flatten(value[k], leaves, f"{where}[{k!r}]", symbolic=symbolic) for k in keys))
    if isinstance(value, (tuple, list)):
        return _Seq(type(value), tuple(
            _flatten(v, leaves, f"{where}[{i}]", symbolic=symbolic) for i, v in enumerate(value)))
    raise _Unsupported(where, type(value).__name__)


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _build(recipe: Any, leaves: list | tuple) -> Any:
    """The Python value ``recipe`` describes, with ``leaves`` in the tensors' places."""
    if isinstance(recipe, _Leaf):
        return leaves[recipe.index]
    if isinstance(recipe, _Const):
        return recipe.value
    items = [_build(item, leaves) for item in recipe.items]
    if isinstance(recipe, _Fields):
        return recipe.cls(**dict(zip(recipe.names, items)))
    if isinstance(recipe, _Map):
        pairs = dict(zip(recipe.keys, items))
        return pairs if recipe.cls is dict else recipe.cls(pairs)
    if _is_namedtuple(recipe.cls):
        return recipe.cls(*items)
    return recipe.cls(items)


def _emit(graph: fx.Graph, recipe: Any, leaves: list) -> Any:
    """``_build`` as graph code: an fx argument, with constructor calls for container classes."""
    if isinstance(recipe, _Leaf):
        return leaves[recipe.index]
    if isinstance(recipe, _Const):
        return recipe.value
    items = [_emit(graph, item, leaves) for item in recipe.items]
    if isinstance(recipe, _Fields):
        return graph.call_function(recipe.cls, (), dict(zip(recipe.names, items)))
    if isinstance(recipe, _Map):
        pairs = dict(zip(recipe.keys, items))
        return pairs if recipe.cls is dict else graph.call_function(recipe.cls, (pairs,))
    if recipe.cls in (tuple, list):
        return recipe.cls(items)
    if _is_namedtuple(recipe.cls):
        return graph.call_function(recipe.cls, tuple(items))
    return graph.call_function(recipe.cls, (tuple(items),))


def _extract(graph: fx.Graph, recipe: Any, node: fx.Node, out: dict[int, fx.Node]) -> None:
    """Graph nodes reading each tensor of ``recipe`` out of the value ``node`` holds."""
    if isinstance(recipe, _Leaf):
        out[recipe.index] = node
        return
    if isinstance(recipe, _Const):
        return
    keys = (recipe.names if isinstance(recipe, _Fields) else
            recipe.keys if isinstance(recipe, _Map) else range(len(recipe.items)))
    for key, item in zip(keys, recipe.items):
        if _has_leaf(item):
            read = (graph.call_function(getattr, (node, key)) if isinstance(recipe, _Fields)
                    else graph.call_function(operator.getitem, (node, key)))
            _extract(graph, item, read, out)


def _has_leaf(recipe: Any) -> bool:
    if isinstance(recipe, _Leaf):
        return True
    return not isinstance(recipe, _Const) and any(_has_leaf(i) for i in recipe.items)


# ---------------------------------------------------------------------------------------------
# The guard: the first node of each graph


@dataclass(frozen=True)
class _TensorSpec:
    dims: tuple  # int (fixed) or str (a symbol shared by every dim of that size)
    dtype: torch.dtype
    device_type: str


class InputGuard:
    """Raises ``InputError`` when a call's inputs differ from what the graph was captured for.

    Called by the graph with forward's arguments, in placeholder order. ``params`` is each
    argument's name and recipe; ``tensors`` the fixed dims (int) or symbols (str) of each tensor;
    ``ranges`` each symbol's (lowest, highest or None) size.
    """

    __name__ = "fxopt_input_guard"

    def __init__(self, model_name: str, params: tuple, tensors: tuple[_TensorSpec, ...],
                 ranges: dict[str, tuple[int, int | None]]):
        self.model_name = model_name
        self.params = params
        self.tensors = tensors
        self.ranges = dict(ranges)

    def _key(self) -> tuple:
        return (self.model_name, self.params, self.tensors, tuple(sorted(self.ranges.items())))

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
        raise InputError(f"{self.model_name} was captured by torch.export {what}",
                         where=f"{self.model_name}.forward argument {where}", hint=hint)

    def _match(self, recipe: Any, value: Any, where: str, found: dict) -> None:
        recapture = ("capture again with example inputs like this call "
                     "(fxopt.capture.export_frontend.capture_with_export(model, args, kwargs))")
        if isinstance(recipe, _Leaf):
            if not isinstance(value, torch.Tensor):
                self._fail(f"with {where} a tensor; this call gives {_describe(value)}",
                           where, recapture)
            found[recipe.index] = (where, value)
            return
        if isinstance(recipe, _Const):
            if type(value) is not type(recipe.value) or not _same_plain(value, recipe.value):
                self._fail(f"with {where}={recipe.value!r}, which the graph has built in; this "
                           f"call gives {_describe(value)}", where, recapture)
            return
        if type(value) is not recipe.cls:
            self._fail(f"with {where} a {recipe.cls.__name__}; this call gives "
                       f"{_describe(value)}", where, recapture)
        if isinstance(recipe, _Fields):
            for name, item in zip(recipe.names, recipe.items):
                self._match(item, getattr(value, name), f"{where}.{name}", found)
        elif isinstance(recipe, _Map):
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

    def _check_tensor(self, spec: _TensorSpec, where: str, t: torch.Tensor,
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


def _describe(value: Any) -> str:
    return repr(value) if type(value) in _PLAIN else f"a {type(value).__name__}"


# ---------------------------------------------------------------------------------------------
# Export


class _Recorder:
    """What ``_Flat.forward`` saw while export ran it. Held by fxopt, not read back from the
    wrapper: export restores every traced module's plain attributes from a snapshot when done."""

    def __init__(self) -> None:
        self.out_recipe: Any = None
        self.reassigned: list[str] = []  # parameters and buffers forward replaced


@dataclass(frozen=True)
class _Call:
    """The example call: each given argument's recipe by name, and which of them were passed
    positionally and which by keyword (a decorator may tell them apart)."""

    given: dict[str, Any]
    positional: tuple[str, ...]
    keywords: tuple[str, ...]


class _Flat(nn.Module):
    """What is exported: ``forward(*tensors)`` rebuilds the user's arguments, calls the model, and
    returns the tensors of its output flat, recording the output's recipe."""

    def __init__(self, inner: nn.Module, call: _Call, recorder: _Recorder):
        super().__init__()
        setattr(self, _INNER, inner)
        self.call = call
        self.recorder = recorder

    def forward(self, *tensors: torch.Tensor) -> tuple:
        args = [_build(self.call.given[name], tensors) for name in self.call.positional]
        kwargs = {name: _build(self.call.given[name], tensors) for name in self.call.keywords}
        inner = getattr(self, _INNER)
        before = _state(inner)
        output = inner(*args, **kwargs)
        after = _state(inner)
        self.recorder.reassigned = [name for name, t in before.items() if after.get(name) is not t]
        leaves: list = []
        self.recorder.out_recipe = _flatten(output, leaves, "output", symbolic=True)
        return tuple(leaves)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


@dataclass
class _Exported:
    program: Any  # torch.export.ExportedProgram
    out_recipe: Any


@contextlib.contextmanager
def _all_modules_in(module: nn.Module, training: bool) -> Iterator[None]:
    flags = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _export(shell: nn.Module, call: _Call, example: tuple, dynamic: bool, training: bool
            ) -> _Exported:
    recorder = _Recorder()
    wrapper = _Flat(shell, call, recorder)
    shapes = None
    if dynamic:
        shapes = (tuple({0: Dim.AUTO} if t.dim() else None for t in example),)
    with _all_modules_in(wrapper, training):
        program = torch.export.export(wrapper, example, dynamic_shapes=shapes, strict=False)
    if recorder.out_recipe is None:
        raise TraceError("torch.export never ran forward", where="capture_with_export",
                         hint="report this to fxopt")
    if recorder.reassigned:
        # torch.export (2.14) records the update of a reassigned buffer only for the exported
        # root's own buffers, and drops it silently for every submodule's.
        name = recorder.reassigned[0]
        raise TraceError(
            f"{type(shell).__name__}'s forward assigns a new tensor to {name!r}; torch.export "
            "drops such updates, so the captured module would never update it",
            where=f"{type(shell).__name__}.forward",
            hint=f"update it in place instead (self.{name.rpartition('.')[2]}.add_(1), "
                 f"self.{name.rpartition('.')[2]}.copy_(new_value))")
    return _Exported(program, recorder.out_recipe)


def _user_input_specs(exported: _Exported, names: list[str]) -> list[_TensorSpec] | None:
    """Each tensor input's dims as exported; None if a size is an expression, not one symbol."""
    program = exported.program
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    specs = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = by_name[spec.arg.name].meta["val"]
        dims = []
        for size in val.shape:
            if isinstance(size, int):
                dims.append(size)
            elif str(size).isidentifier():
                dims.append(str(size))
            else:
                return None
        specs.append(_TensorSpec(tuple(dims), val.dtype, val.device.type))
    return specs if len(specs) == len(names) else None


def _ranges(program: Any) -> dict[str, tuple[int, int | None]]:
    """Each symbol's size range, the highest None when unbounded."""
    ranges = {}
    for symbol, span in program.range_constraints.items():
        ranges[str(symbol)] = (_bound(span.lower, 0), _bound(span.upper, None))
    return ranges


def _bound(value: Any, unbounded: int | None) -> int | None:
    if not getattr(value, "is_finite", True):  # sympy's (and torch's integer) infinity
        return unbounded
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return unbounded


def _trace_error(model: nn.Module, error: BaseException, mode: str) -> TraceError:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    name = type(error).__name__
    if "data" in name.lower() or "data-dependent" in text or "DataDependent" in text:
        hint = ("forward branches on tensor values; rewrite it with torch.where / torch.cond, or "
                "use fxopt.trace(model, inputs), which keeps such code as an opaque leaf")
    else:
        hint = ("use fxopt.trace(model, inputs) (symbolic tracing, with opaque-leaf fallback), or "
                "run torch.export.draft_export(model, args, kwargs) to list every problem")
    return TraceError(f"torch.export cannot capture {type(model).__name__}.forward in {mode} "
                      f"mode: {name}: {first}", where=user_frame(error), hint=hint)


# ---------------------------------------------------------------------------------------------
# Building the GraphModule


@dataclass
class _Placeholder:
    name: str
    recipe: Any  # what the example held (or the default it was captured at)
    default: Any = inspect.Parameter.empty


def _placeholders(model_name: str, signature: inspect.Signature, given: dict[str, Any]
                  ) -> list[_Placeholder]:
    """forward's parameters the graph takes, in forward's order.

    Parameters after the last one given are left out (calling with one is a TypeError): the
    model used its own default, which a decorator may set differently from what the signature
    says. A parameter skipped before a given one keeps its place, at its default, so positional
    calls bind as they do on the model; the guard refuses any other value. A given parameter has
    no default unless Python needs one after a defaulted parameter; that default is None, which
    the guard refuses unless None was captured.
    """
    params = [p for p in signature.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    last = max(i for i, p in enumerate(params) if p.name in given)
    result: list[_Placeholder] = []
    for param in params[:last + 1]:
        if param.name in given:
            default = None if any(p.default is not param.empty for p in result) else param.empty
            result.append(_Placeholder(param.name, given[param.name], default))
        elif param.default is not param.empty and type(param.default) in _PLAIN:
            result.append(_Placeholder(param.name, _Const(param.default), param.default))
        else:
            raise TraceError(
                f"{model_name}.forward's argument {param.name!r} comes before arguments the "
                f"example gives, and its default ({_describe(param.default)}) cannot be written "
                "in the captured module's signature", where=f"{model_name}.forward{signature}",
                hint=f"pass {param.name} explicitly in the example inputs")
    return result


def _unlift(exported: _Exported, placeholders: list[_Placeholder], model_name: str,
            attributes: dict[str, Any], shell: nn.Module, leaf_names: list[str]) -> fx.Graph:
    """The exported graph with forward's arguments as placeholders, the user's parameters and
    buffers as ``get_attr`` nodes, buffer mutations written back, and the output rebuilt."""
    program = exported.program
    graph = fx.Graph()
    nodes = [graph.placeholder(p.name, default_value=p.default) for p in placeholders]
    specs = _user_input_specs(exported, leaf_names)
    assert specs is not None
    guard = InputGuard(model_name, tuple((p.name, p.recipe) for p in placeholders),
                       tuple(specs), _ranges(program))
    torch.fx.node.has_side_effect(guard)  # so dead-code elimination keeps it
    graph.call_function(guard, tuple(nodes))
    leaves: dict[int, fx.Node] = {}
    for p, node in zip(placeholders, nodes):
        _extract(graph, p.recipe, node, leaves)

    env: dict[fx.Node, Any] = {}
    inputs: dict[str, fx.Node] = {}  # the exported graph's input names -> our nodes
    kinds = {s.arg.name: s for s in program.graph_signature.input_specs}
    user_inputs = 0
    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = kinds[node.name]
            if spec.kind == InputKind.USER_INPUT:
                env[node] = inputs[node.name] = leaves[user_inputs]
                user_inputs += 1
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                env[node] = graph.get_attr(_attribute(spec, program, attributes, shell))
                env[node].meta.update(node.meta)
            else:
                raise TraceError(
                    f"torch.export gave {model_name} an input of kind {spec.kind.name} "
                    f"({spec.target}), which fxopt cannot run as a plain GraphModule",
                    where=f"{model_name}.forward", hint="use fxopt.trace(model, inputs)")
        elif node.op == "get_attr":  # a higher-order operator's body
            value = operator.attrgetter(node.target)(program.graph_module)
            name = next((n for n, v in attributes.items() if v is value), None)
            if name is None:
                name = f"{_ATTRIBUTE_PREFIX}{node.target.replace('.', '_')}_{len(attributes)}"
                attributes[name] = value
            env[node] = graph.get_attr(name)
        elif node.op == "output":
            _output(graph, exported, node, env, inputs, model_name)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            _strip_wrapper(env[node])
    graph.lint()
    return graph


def _attribute(spec: Any, program: Any, attributes: dict[str, Any], shell: nn.Module) -> str:
    """The ``get_attr`` target of a lifted parameter, buffer or constant, on ``shell``."""
    target = spec.target.removeprefix(_INNER + ".")
    if spec.kind != InputKind.CONSTANT_TENSOR:
        return target
    value = program.constants[spec.target]
    try:
        if operator.attrgetter(target)(shell) is value:
            return target  # a plain tensor attribute of one of the model's modules
    except AttributeError:
        pass
    for name, existing in attributes.items():
        if existing is value:
            return name
    name = f"{_ATTRIBUTE_PREFIX}constant_{len(attributes)}"
    attributes[name] = value
    return name


def _output(graph: fx.Graph, exported: _Exported, node: fx.Node, env: dict,
            inputs: dict[str, fx.Node], model_name: str) -> None:
    returned = list(node.args[0])
    user: list = []
    for spec, value in zip(exported.program.graph_signature.output_specs, returned):
        new = env[value] if isinstance(value, fx.Node) else value
        if spec.kind == OutputKind.USER_OUTPUT:
            user.append(new)
        elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION,
                           OutputKind.PARAMETER_MUTATION):
            into = (inputs[spec.target] if spec.kind == OutputKind.USER_INPUT_MUTATION
                    else graph.get_attr(spec.target.removeprefix(_INNER + ".")))
            graph.call_function(torch.ops.aten.copy_.default, (into, new))
        else:
            raise TraceError(
                f"torch.export gave {model_name} an output of kind {spec.kind.name}, which fxopt "
                "cannot run as a plain GraphModule", where=f"{model_name}.forward",
                hint="use fxopt.trace(model, inputs)")
    graph.output(_emit(graph, exported.out_recipe, user))


def _strip_wrapper(node: fx.Node) -> None:
    """Module paths in ``nn_module_stack`` as the user's model names them (no wrapper, no root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return
    kept = {}
    for key, (path, kind) in stack.items():
        if path == _INNER or not path.startswith(_INNER + "."):
            continue
        kept[key] = (path.removeprefix(_INNER + "."), kind)
    node.meta["nn_module_stack"] = kept


# ---------------------------------------------------------------------------------------------
# The entry point


def _bind(model: nn.Module, args: tuple, kwargs: dict[str, Any]
          ) -> tuple[inspect.Signature, dict[str, Any], dict[str, Any], list]:
    """forward's signature, each given argument's recipe, and the example tensors, flat."""
    name = type(model).__name__
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise InputError(f"{name}.forward cannot be called with these example inputs: {error}",
                         where=f"{name}.forward",
                         hint="pass args as a tuple of forward's positional arguments and kwargs "
                              "as a dict of its keyword arguments") from error
    variadic = [p.name for p in signature.parameters.values()
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name in bound.arguments]
    if variadic:
        raise TraceError(
            f"{name}.forward takes *{variadic[0]}, which the example inputs reach: fxopt needs a "
            "named parameter for every input it captures",
            where=f"{name}.forward{signature}",
            hint="give forward named parameters, or wrap it with functools.wraps so its "
                 "signature names them")
    leaves: list = []
    given: dict[str, Any] = {}
    for arg_name, value in bound.arguments.items():
        try:
            given[arg_name] = _flatten(value, leaves, arg_name)
        except _Unsupported as error:
            raise InputError(
                f"example input {error.where} is a {error.kind}, which fxopt cannot pass to "
                "torch.export", where=f"{name}.forward argument {error.where}",
                hint="pass tensors, plain values (None, bool, int, float, str) and tuples, "
                     "lists, dicts and dataclasses of them") from error
    if not leaves:
        raise InputError("the example inputs contain no tensor", where=f"{name}.forward",
                         hint="pass the tensors forward takes, e.g. (torch.randn(8, 3, 32, 32),)")
    return signature, bound.arguments, given, leaves


def _refuse_hooks(model: nn.Module) -> None:
    for path, module in model.named_modules():
        kinds = call_hooks(module)
        if kinds:
            raise TraceError(
                f"{type(model).__name__} has {' and '.join(kinds)} on "
                f"{path or 'the model itself'}: torch.export would run them once, while "
                "capturing, and never again",
                where=f"{path or '<root>'} ({type(module).__name__})",
                hint="remove the hooks before capturing, or use fxopt.trace(model, inputs), "
                     "which keeps hooked modules as calls")


def _leaf_names(given: dict[str, Any]) -> list[str]:
    names: dict[int, str] = {}

    def walk(recipe: Any, where: str) -> None:
        if isinstance(recipe, _Leaf):
            names[recipe.index] = where
        elif not isinstance(recipe, _Const):
            keys = (recipe.names if isinstance(recipe, _Fields) else
                    recipe.keys if isinstance(recipe, _Map) else range(len(recipe.items)))
            for key, item in zip(keys, recipe.items):
                walk(item, f"{where}.{key}" if isinstance(recipe, _Fields) else
                     f"{where}[{key!r}]")

    for name, recipe in given.items():
        walk(recipe, name)
    return [names[i] for i in sorted(names)]


def capture_with_export(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None = None
                        ) -> fx.GraphModule:
    """Capture ``model`` called as ``model(*args, **kwargs)`` with ``torch.export`` (non-strict,
    training IR) as a GraphModule owning the model's Parameters and buffers; see the module
    docstring for what the result promises and what is not handled.

    Raises ``InputError`` for inputs forward cannot take, ``TraceError`` when export fails.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"capture_with_export needs a torch.nn.Module, got {type(model).__name__}",
                         hint="pass the model object itself")
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    name = type(model).__name__
    start = time.perf_counter()
    _refuse_hooks(model)
    signature, arguments, given, example = _bind(model, args, kwargs)
    leaf_names = _leaf_names(given)
    call = _Call(given, tuple(list(arguments)[:len(args)]), tuple(kwargs))
    # Distinct copies: export would otherwise treat two arguments that are one tensor as
    # aliases for ever after.
    example = tuple(t.detach().clone() for t in example)

    shell = structural_copy(model)
    static_reason: str | None = None
    exports: list[_Exported] = []
    with preserved_state(model, shell):
        for dynamic in (True, False):
            exports = []
            try:
                for training in (True, False):
                    exports.append(_export(shell, call, example, dynamic, training))
            except FxoptError:
                raise
            except Exception as error:  # torch.export raises many types; all become TraceError
                if dynamic:
                    static_reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                    continue
                raise _trace_error(model, error, "eval" if exports else "train") from error
            if all(_user_input_specs(e, leaf_names) is not None for e in exports):
                break
            static_reason = "a size relation between inputs is an expression, not one size"
        placeholders = _placeholders(name, signature, given)
        attributes: dict[str, Any] = {}
        graphs = [_unlift(e, placeholders, name, attributes, shell, leaf_names) for e in exports]
    for attr, value in attributes.items():
        object.__setattr__(shell, attr, value)
    gm = graph_module_like(shell, graphs[0])
    for attr, value in attributes.items():
        if attr not in vars(gm):
            object.__setattr__(gm, attr, value)
    info = TraceInfo()
    if not same_graph(graphs[0], graphs[1], gm):
        install_eval_graph(gm, graphs[1])
        info.mode_dependent = True
    _propagate(model, gm, placeholders, arguments)
    if info.mode_dependent:
        _propagate(model, codegen_of(gm.graph).eval_forward.eval_module, placeholders, arguments)
    specs = _user_input_specs(exports[0], leaf_names) or []
    dynamic_dims = tuple(f"{leaf}.shape[{d}]" for leaf, spec in zip(leaf_names, specs)
                         for d, size in enumerate(spec.dims) if isinstance(size, str))
    info.seconds = time.perf_counter() - start
    gm.meta["fxopt_trace"] = info
    gm.meta["fxopt_export"] = ExportInfo(dynamic_dims, static_reason if not dynamic_dims else None)
    return gm


def _propagate(model: nn.Module, gm: fx.GraphModule, placeholders: list[_Placeholder],
               arguments: dict[str, Any]) -> None:
    values = tuple(arguments[p.name] if p.name in arguments else p.default for p in placeholders)
    try:
        propagate_meta(gm, values)
    except FxoptError:
        raise
    except Exception as error:
        node = getattr(error, "_fxopt_node", None)
        raise TraceError(
            f"fxopt cannot compute shapes of {type(model).__name__}'s exported graph on fake "
            f"tensors: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            where=f"node {node.name}" if node is not None else type(model).__name__,
            hint="use fxopt.trace(model, inputs), or report this model to fxopt") from error
