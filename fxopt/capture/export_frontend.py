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
  (``fxopt.graph.train_eval``), so ``.train()`` / ``.eval()`` switch dropout and BatchNorm;
- carries ``meta["val"]`` on every node (``fxopt.graph.meta.propagate_meta``) and
  ``meta["fxopt_trace"]`` (a ``TraceInfo``: frontend "export", no leaves, ``mode_dependent``) and
  ``meta["fxopt_export"]`` (an ``ExportInfo``: which input sizes stayed dynamic, whether a
  batch of 1 is served, why a way of exporting was given up).

The graph is torch.export's training IR (``torch.export.export`` traces pre-dispatch on torch
2.14; there is no separate public ``export_for_training``): ATen operators above autograd, such
as ``aten.linear``, ``aten.dropout(x, p, train)``, ``aten.scaled_dot_product_attention``,
``aten.batch_norm`` updating the running statistics in place. Run eagerly, autograd
differentiates it as it does the model, and dropout draws from the global RNG as the model does.

Input sizes: every dimension of every tensor input is exported as ``Dim.AUTO`` (dynamic unless the
model fixes it), so one capture serves every batch size and sequence length the model's code
allows, with sizes 0 and 1 traced apart (``backed_size_oblivious``) and a batch of 1 served when a
second trace at batch 1 records the same graph (``fxopt.capture.export_guards``, which also turns
the conditions torch.export recorded on sizes into the guard's checks). A dimension fxopt cannot
check (an expression of other sizes, a condition it cannot read) is fixed and the export repeated;
if export fails it is repeated without tracing 0 and 1 apart, then with static sizes
(``ExportInfo.fallbacks``). With ``dynamic=False`` every size is the example's from the start: two
traces (train and eval mode) instead of three, each without symbolic size arithmetic (2-3 times
faster on Hugging Face language models), and the guard refuses any other size. Dtypes, device
types, plain argument values (``None``, flags) and container structure are fixed. The graph starts
with a guard node (``guard_inputs`` reading the module's ``InputGuard``, with the parameters and
buffers the graph reads) that raises ``InputError`` before anything is computed when a call does
not match what was captured (a size the model fixes, a length of 1, two sizes that must agree and
do not, ``labels=None`` when it was captured with labels, a module converted to another dtype
after capture), instead of computing something else. Devices export baked into the
graph (factory ops' ``device=``, ``aten.to``, ``_assert_tensor_metadata``) are read from a
parameter, buffer or input when the graph runs (``fxopt.capture.export_devices``), so a module
moved to another device of the same type (``cuda:0`` to ``cuda:1``) computes there, and where no
graph names a device type (an autocast scope does) the guard is portable: the whole module may
move to another device type (``fxopt.runtime.input_guard``). Arguments after
the last one the example gives are not parameters of the captured module (passing one is Python's
``TypeError``): the model used its own default, which a decorator may set differently from what the
signature says. An argument skipped before a given one stays in its place at its default, and the
guard refuses any other value.

Safe when: forward's tensor computation does not depend on tensor *values* (``if x.sum() > 0``
fails with ``TraceError``; ``fxopt.capture.trace`` keeps such code as an opaque leaf instead), and
forward's Python side effects are in-place updates of parameters and buffers (a forward that
*assigns* a buffer, ``self.count = self.count + 1``, is refused: torch.export drops that update for
every module but the exported root). The user's model is never modified: training flags,
parameters, buffers, gradients, plain attributes (export itself restores the plain attributes of
every module it traced from copies, which is one reason it runs on a structural copy) and the
RNG state are as before.

Not handled (``TraceError`` unless said otherwise): modules with hooks (export would run them once,
at capture time); forwards that call ``torch.utils.checkpoint`` (export would inline it, dropping
the recomputation); forward signatures without names for the inputs given (a bare ``*args,
**kwargs`` with no ``functools.wraps``); example inputs other than tensors, plain values and
containers of them; output containers other than those listed; sizes whose exported relation is
an expression (``y.shape[0] == 2 * x.shape[0]``: re-exported with that size fixed, see
``ExportInfo.fallbacks``). Submodules left in another training mode than the root on purpose
(a frozen BatchNorm): the train graph has every module in train mode and the eval graph every
module in eval mode, and a submodule's own flag is never read again; the optimized module's call
guard refuses a BatchNorm or Dropout in another mode than the root's on every call
(``fxopt.integrations.call_guard``), a module of the user's own class is not detected. Not
supported:
another dtype than the capture's, for inputs or for the module's parameters and buffers, nor
another device type where a graph names the capture's (the guard refuses it: capture the model
after converting it; so ``fxopt.verify``'s float64 re-check of rounding differences runs the
original alone in float64 and judges the captured module's float32 error against the
original's own, ``fxopt.verify.rounding``). The graph's
operators are ATen operators, not the module calls and ``torch.nn.functional`` calls fxopt's
passes were written for: see ``tests/test_export_frontend.py`` for which passes apply.

This module runs the export and unlifts its program into the GraphModule. The pieces it uses:
``fxopt.capture.export_signature`` (binding the example call to forward's signature),
``fxopt.capture.export_guards`` (what sizes an exported program serves),
``fxopt.capture.recipes`` (nested inputs and outputs as recipes, rebuilt in the graph) and
``fxopt.runtime.input_guard`` (the guard node, which the captured module calls while it runs).
"""

from __future__ import annotations

import contextlib
import operator
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from fxopt.capture.exception_safe import exception_safe
from fxopt.capture.export_guards import (
    Constraints,
    batch_group,
    constraints_of,
    cut_to_one,
    same_program,
    unusable_dims,
    with_batch_of_one,
    without_batch_of_one,
)
from fxopt.capture.export_signature import (
    Placeholder,
    bind_example,
    signature_placeholders,
)
from fxopt.capture.export_devices import device_types_built_in, follow_devices
from fxopt.capture.export_leaves import exported_keeping_leaves
from fxopt.graph.fake_run import module_state, training_flags
from fxopt.capture.leaf_recording import record_leaf_runs
from fxopt.capture.recipes import Unsupported, build, emit, extract, flatten, leaf_paths
from fxopt.capture.trace import LeafFallback, TraceInfo
from fxopt.graph.graphs import graph_module_like
from fxopt.capture.trace_checks import (
    UserCheckpoint,
    in_words,
    propagate_meta_explained,
    user_checkpoints_refused,
    user_frame,
)
from fxopt.graph.pickling import refuse_pickling
from fxopt.graph.train_eval import (
    eval_module_on,
    install_eval_graph,
    modules_the_mode_changes,
    same_graph,
)
from fxopt.core import meta_keys
from fxopt.core.errors import FxoptError, InputError, TraceError
from fxopt.core.modules import call_hooks, structural_copy
from fxopt.core.state import preserved_state
from fxopt.core.torch_private import (
    ASSERT_TENSOR_METADATA,
    fake_tensor_cache_off,
    size_oblivious_export,
)
from fxopt.runtime.input_guard import InputGuard, TensorSpec, autocast_state, guard_inputs

_ATTRIBUTE_PREFIX = "_fxopt_export_"
_INNER = "inner"  # the model's attribute name inside the exported wrapper
_GUARD = "_fxopt_input_guard"  # the captured module's attribute holding its InputGuard
_CONSTANT = f"{_ATTRIBUTE_PREFIX}constant_"  # a tensor constant export lifted out of forward


@dataclass(frozen=True)
class ExportInfo:
    """How the model was exported: ``dynamic`` names the input sizes left free (e.g.
    ``input_ids.shape[0]``, ``input_ids.shape[1]``); ``batch_of_one``: whether a batch of 1 is
    served too (``fxopt.capture.export_guards``); ``static_reason`` says why export fell back to
    static sizes; ``fallbacks`` why each way of exporting tried before the one used failed."""

    dynamic: tuple[str, ...] = ()
    static_reason: str | None = None
    batch_of_one: bool = False
    fallbacks: tuple[str, ...] = ()
    traces: int = 0  # torch.export traces made, every attempt counted

    def describe_sizes(self) -> str:
        """One line: the input sizes left free and whether a batch of 1 is served, or why
        every size is the example's."""
        if not self.dynamic:
            return f"sizes: the example's only ({self.static_reason or 'the model fixes them'})"
        return (f"sizes: {', '.join(self.dynamic)} free"
                + ("; a batch of 1 served too" if self.batch_of_one else ""))


# How forward is exported, tried in order until one works: every dimension dynamic with sizes
# 0 and 1 traced apart ("oblivious"); every dimension dynamic, sizes 0 and 1 fixed ("dynamic");
# every size fixed ("static").
_MODES = ("oblivious", "dynamic", "static")
STATIC_BY_REQUEST = "dynamic=False was asked for"


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
        args = [build(self.call.given[name], tensors) for name in self.call.positional]
        kwargs = {name: build(self.call.given[name], tensors) for name in self.call.keywords}
        inner = getattr(self, _INNER)
        before = module_state(inner)
        output = inner(*args, **kwargs)
        after = module_state(inner)
        self.recorder.reassigned = [name for name, t in before.items() if after.get(name) is not t]
        leaves: list = []
        self.recorder.out_recipe = flatten(output, leaves, "output", symbolic=True)
        return tuple(leaves)


@dataclass
class _Exported:
    program: Any  # torch.export.ExportedProgram
    out_recipe: Any


def _export(shell: nn.Module, call: _Call, example: tuple, mode: str, training: bool,
            fixed: frozenset, traced: list[str]) -> _Exported:
    """Export forward in ``mode`` (``_MODES``), every dimension dynamic but those ``fixed``
    ((leaf, dim) pairs); ``traced`` gets ``mode`` appended, one per trace."""
    traced.append(mode)
    recorder = _Recorder()
    wrapper = _Flat(shell, call, recorder)
    shapes = None
    if mode != "static":
        shapes = (tuple({d: Dim.AUTO for d in range(t.dim()) if (leaf, d) not in fixed} or None
                        for leaf, t in enumerate(example)),)
    sizes = size_oblivious_export() if mode == "oblivious" else contextlib.nullcontext()
    try:
        with (training_flags(wrapper, training), user_checkpoints_refused(), sizes,
              fake_tensor_cache_off()):
            program = torch.export.export(wrapper, example, dynamic_shapes=shapes, strict=False)
    except Exception as error:
        if _caused_by(error, UserCheckpoint):
            # Exported through, the user's checkpoint would be inlined: its recomputation lost.
            raise TraceError(
                f"{type(shell).__name__} calls torch.utils.checkpoint, which torch.export would "
                "inline, silently dropping the recomputation", where=user_frame(error),
                hint="use fxopt.trace(model, inputs) (capture='fx'), which keeps the module "
                     "that calls it as written, or remove the checkpoint and pass "
                     "memory_budget= to let fxopt plan the recomputation") from error
        unsupported = _cause(error, Unsupported)
        if unsupported is not None and unsupported.where.startswith("output"):
            raise _output_error(shell, unsupported) from error
        raise
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


def _caused_by(error: BaseException | None, kind: type) -> bool:
    return _cause(error, kind) is not None


def _cause(error: BaseException | None, kind: type) -> Any:
    """The first exception of type ``kind`` in ``error``'s chain of causes, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _output_error(model: nn.Module, unsupported: Unsupported) -> TraceError:
    name = type(model).__name__
    if "cache" in unsupported.kind.lower():
        hint = ("call it with use_cache=False (add use_cache=False to example_kwargs, or set "
                "model.config.use_cache = False): a training step does not need the cache")
    else:
        hint = ("return tensors, plain values, and tuples, lists, dicts or dataclasses of them "
                "(wrap the model in a module that returns what the loss needs)")
    return TraceError(f"{name}'s {unsupported.where} is a {unsupported.kind}, which "
                      "fxopt cannot rebuild in the captured module",
                      where=f"{name}.forward output", hint=hint)


def _trace_error(model: nn.Module, error: BaseException, mode: str) -> TraceError:
    text = str(error).strip()
    name = type(error).__name__
    if "data" in name.lower() or "data-dependent" in text or "DataDependent" in text:
        # Not "use capture='fx'": a submodule export fails in is kept opaque here already
        # (fxopt.capture.export_leaves), and fx may not trace the root (issue 25: circular hints)
        hint = ("forward reads tensor values (data-dependent control flow or shapes) where no "
                "submodule can be kept opaque around it: move that code into a submodule's "
                "forward (fxopt keeps such a submodule as an opaque leaf, under capture='fx' "
                "and capture='export' alike, run for real on the example inputs), name the "
                "submodule in leaf_modules=('path',) if it is one, or rewrite the code with "
                "torch.where / torch.cond")
    else:
        hint = ("use fxopt.trace(model, inputs) (symbolic tracing, with opaque-leaf fallback), or "
                "run torch.export.draft_export(model, args, kwargs) to list every problem")
    return TraceError(f"torch.export cannot capture {type(model).__name__}.forward in {mode} "
                      f"mode: {in_words(error)}", where=user_frame(error), hint=hint)


# ---------------------------------------------------------------------------------------------
# Building the GraphModule


def _autocast_to_keep(program: Any, devices: tuple[torch.device, ...], state: list) -> tuple:
    """The autocast a call of the captured graph must run under (``InputGuard.autocast``), or
    ``()`` for any. A graph traced under autocast has its casts built in, and computes in
    reduced precision under no other. One traced in full precision re-dispatches through a
    call's autocast as the model's code does, unless torch.export turned a cast that was a no-op
    into a check of the dtype (``_assert_tensor_metadata``: an RMSNorm's ``.to(torch.float32)``),
    which a call under autocast would fail, and where the model would have cast."""
    device_types = dict.fromkeys(["cpu", *(d.type for d in devices), *(t for *_, t in state)])
    captured = autocast_state(device_types)
    if any(dtype is not None for _, dtype in captured):
        return captured
    checks_dtypes = any(node.op == "call_function" and node.target in ASSERT_TENSOR_METADATA
                        and isinstance(node.kwargs.get("dtype"), torch.dtype)
                        and node.kwargs["dtype"].is_floating_point
                        for module in program.graph_module.modules()
                        if isinstance(module, fx.GraphModule) for node in module.graph.nodes)
    return captured if checks_dtypes else ()


def _unlift(exported: _Exported, placeholders: list[Placeholder], model_name: str,
            attributes: dict[str, Any], shell: nn.Module, constraints: Constraints,
            devices: tuple[torch.device, ...], *, static: bool = False) -> fx.Graph:
    """The exported graph with forward's arguments as placeholders, the user's parameters and
    buffers as ``get_attr`` nodes, buffer mutations written back, and the output rebuilt. The
    guard node comes first after the ``get_attr`` nodes of the parameters and buffers, which it
    checks with the arguments (``InputGuard``; ``static``: captured with ``dynamic=False``).
    The devices export baked in follow the parameters, buffers and inputs (``devices``: the
    example tensors') at call time (``fxopt.capture.export_devices``)."""
    program = exported.program
    graph = fx.Graph()
    nodes = [graph.placeholder(p.name, default_value=p.default) for p in placeholders]
    env: dict[fx.Node, Any] = {}
    kinds = {s.arg.name: s for s in program.graph_signature.input_specs}
    state: list[tuple[str, torch.dtype, str]] = []
    read: list[fx.Node] = []  # the parameters and buffers, as get_attr nodes the guard checks
    for node in program.graph.find_nodes(op="placeholder"):
        spec = kinds[node.name]
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            env[node] = graph.get_attr(_attribute(spec, program, attributes, shell))
            env[node].meta.update(node.meta)
            if spec.kind != InputKind.CONSTANT_TENSOR:  # constants are fxopt's, never converted
                val = node.meta["val"]
                state.append((env[node].target, val.dtype, val.device.type))
                read.append(env[node])
    guard = InputGuard(model_name, tuple((p.name, p.recipe) for p in placeholders),
                       tuple(constraints.specs), constraints.ranges,
                       checks=tuple(constraints.checks), state=tuple(state),
                       static=static, autocast=_autocast_to_keep(program, devices, state))
    guard_name = next((n for n, v in attributes.items()
                       if isinstance(v, InputGuard) and v == guard), None)
    if guard_name is None:  # the eval graph's guard is the train graph's unless sizes differ
        guard_name = _GUARD if _GUARD not in attributes else f"{_GUARD}_{len(attributes)}"
        attributes[guard_name] = guard
    graph.call_function(guard_inputs, (graph.get_attr(guard_name), *nodes),
                        {"state": tuple(read)} if read else {})
    leaves: dict[int, fx.Node] = {}
    for p, node in zip(placeholders, nodes):
        extract(graph, p.recipe, node, leaves)

    inputs: dict[str, fx.Node] = {}  # the exported graph's input names -> our nodes
    user_inputs = 0
    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = kinds[node.name]
            if spec.kind == InputKind.USER_INPUT:
                env[node] = inputs[node.name] = leaves[user_inputs]
                user_inputs += 1
            elif node in env:
                pass
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
    follow_devices(graph, attributes, state=read,
                   inputs=[(leaves[i], device) for i, device in enumerate(devices) if i in leaves],
                   constants=frozenset(n for n in attributes if n.startswith(_CONSTANT)))
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
    name = f"{_CONSTANT}{len(attributes)}"
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
    graph.output(emit(graph, exported.out_recipe, user))


def _strip_wrapper(node: fx.Node) -> None:
    """Module paths in ``nn_module_stack`` as the user's model names them (no wrapper, no root)."""
    stack = node.meta.get(meta_keys.NN_MODULE_STACK)
    if not stack:
        return
    kept = {}
    for key, (path, kind) in stack.items():
        if path == _INNER or not path.startswith(_INNER + "."):
            continue
        kept[key] = (path.removeprefix(_INNER + "."), kind)
    node.meta[meta_keys.NN_MODULE_STACK] = kept


# ---------------------------------------------------------------------------------------------
# The entry point


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


def capture_with_export(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None = None,
                        *, leaf_modules: tuple[str, ...] = (),
                        opaque_on_failure: bool = True, dynamic: bool = True) -> fx.GraphModule:
    """Capture ``model`` called as ``model(*args, **kwargs)`` with ``torch.export`` (non-strict,
    training IR) as a GraphModule owning the model's Parameters and buffers; see the module
    docstring for what the result promises and what is not handled. ``leaf_modules`` (and,
    with ``opaque_on_failure``, any submodule export fails in on data-dependent code) are kept
    as opaque module calls (``fxopt.capture.export_leaves``). ``dynamic=False`` exports at the
    example's sizes only (``STATIC_BY_REQUEST`` is then the ``ExportInfo.static_reason``).

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
    signature, arguments, given, example = bind_example(model, args, kwargs)
    leaf_names = leaf_paths(given)
    call = _Call(given, tuple(list(arguments)[:len(args)]), tuple(kwargs))
    # Distinct copies: export would otherwise treat two arguments that are one tensor as
    # aliases for ever after.
    example = tuple(t.detach().clone() for t in example)

    shell = structural_copy(model)
    traced: list[str] = []  # every torch.export trace, retries with more leaves included
    with preserved_state(model, shell):
        (exports, constraints, export_info), opaque, found = exported_keeping_leaves(
            shell, tuple(leaf_modules), lambda: _run_for_real(shell, call, example),
            lambda: _export_modes(model, shell, call, example, leaf_names, traced,
                                  _MODES if dynamic else ("static",)),
            find_more=opaque_on_failure)
        export_info = replace(export_info, traces=len(traced))
        placeholders = signature_placeholders(name, signature, given)
        attributes: dict[str, Any] = {}
        devices = tuple(t.device for t in example)
        graphs = [_unlift(e, placeholders, name, attributes, shell, c, devices,
                          static=not dynamic)
                  for e, c in zip(exports, constraints)]
        for graph in graphs if opaque is not None else ():
            opaque.restore_calls(graph)
    for attr, value in attributes.items():
        object.__setattr__(shell, attr, value)
    for graph in graphs:
        exception_safe(graph, shell, f"{name}.forward")
    gm = graph_module_like(shell, graphs[0])
    for attr, value in attributes.items():
        if attr not in vars(gm):
            object.__setattr__(gm, attr, value)
    info = TraceInfo(frontend="export", traces=export_info.traces,
                     sizes=export_info.describe_sizes(), leaves=[
        LeafFallback(path, type(shell.get_submodule(path)).__name__, why) for path, why in found])
    if not same_graph(graphs[0], graphs[1], gm):
        install_eval_graph(gm, graphs[1])
        info.mode_dependent = True
        info.mode_dependent_modules = modules_the_mode_changes(*graphs)
    _mark_portable(gm)
    if info.mode_dependent:  # first: the leaves' records (one per module) go on both graphs
        _propagate(model, eval_module_on(gm), placeholders, arguments, record=False)
    _propagate(model, gm, placeholders, arguments)
    info.seconds = time.perf_counter() - start
    gm.meta[meta_keys.TRACE] = info
    gm.meta[meta_keys.EXPORT] = export_info
    refuse_pickling(gm)
    return gm


def _mark_portable(gm: fx.GraphModule) -> None:
    """Let ``gm``'s new input guards accept the whole module on another device type when none
    of its graphs names one (``InputGuard.portable``)."""
    if not device_types_built_in(gm):
        for value in vars(gm).values():
            if isinstance(value, InputGuard):
                value.portable = True


def _run_for_real(shell: nn.Module, call: _Call, example: tuple) -> None:
    """The example call of ``shell``, for real, in train mode, without grad."""
    with training_flags(shell, True), torch.no_grad():
        _Flat(shell, call, _Recorder())(*example)


def _export_modes(model: nn.Module, shell: nn.Module, call: _Call, example: tuple,
                  leaf_names: list[str], traced: list[str], modes: tuple[str, ...] = _MODES
                  ) -> tuple[list[_Exported], list[Constraints], ExportInfo]:
    """The train- and eval-mode exports in the first of ``modes`` (``_MODES`` or a part of
    it) that works, what each serves (a batch of 1 added where a second trace allows it), and
    how it went; each trace is appended to ``traced``."""
    fallbacks: list[str] = []
    for mode in modes:
        done: list[_Exported] = []
        try:
            exports, constraints, fixed = _export_both(shell, call, example, mode, done, traced)
        except FxoptError:
            raise
        except Exception as error:  # torch.export raises many types; all become TraceError
            if mode != "static":
                fallbacks.append(f"{mode}: {type(error).__name__}: {str(error).splitlines()[0]}")
                continue
            raise _trace_error(model, error, "eval" if done else "train") from error
        if fixed:
            names = ", ".join(f"{leaf_names[leaf]}.shape[{dim}]" for leaf, dim in sorted(fixed))
            fallbacks.append(f"{mode}: fixed {names}: torch.export made it an expression of other "
                             "sizes, or recorded a condition on it fxopt cannot check")
        if exports:
            break
    batch_of_one = False
    if mode == "oblivious":
        constraints, batch_of_one = _batch_of_one(shell, call, example, exports, constraints,
                                                  fixed, traced)
    dynamic = tuple(f"{leaf}.shape[{d}]" for leaf, spec in zip(leaf_names, constraints[0].specs)
                    for d, size in enumerate(spec.dims) if isinstance(size, str))
    static_reason = (fallbacks[-1].partition(": ")[2] if mode == "static" and fallbacks
                     else STATIC_BY_REQUEST if modes == ("static",) else None)
    return exports, constraints, ExportInfo(dynamic, static_reason if not dynamic else None,
                                            batch_of_one, tuple(fallbacks))


def _export_both(shell: nn.Module, call: _Call, example: tuple, mode: str, done: list,
                 traced: list[str]) -> tuple[list[_Exported], list[Constraints], frozenset]:
    """The train- and eval-mode exports in ``mode`` and their constraints, with the dimensions
    fxopt cannot check fixed (exporting again with them fixed, at most twice); the train
    export comes first and is appended to ``done``."""
    fixed: frozenset = frozenset()
    for _ in range(3):
        done.clear()
        constraints: list[Constraints] = []
        for training in (True, False):
            exported = _export(shell, call, example, mode, training, fixed, traced)
            done.append(exported)
            found = constraints_of(exported.program, example)
            if found is None and mode == "static":  # valid at the example's sizes regardless
                found = _fixed(exported, example)
            if found is None:
                break
            constraints.append(found)
        if len(constraints) == 2:
            return list(done), constraints, fixed
        more = unusable_dims(done[-1].program, example) - fixed
        if not more:
            break
        fixed |= more
    return [], [], fixed


def _fixed(exported: _Exported, example: tuple) -> Constraints:
    """A statically exported program's constraints: its inputs' sizes, nothing else."""
    return Constraints([TensorSpec(tuple(t.shape), t.dtype, t.device.type) for t in example], {})


def _batch_of_one(shell: nn.Module, call: _Call, example: tuple, exports: list[_Exported],
                  constraints: list[Constraints], fixed: frozenset, traced: list[str]
                  ) -> tuple[list[Constraints], bool]:
    """Each mode's constraints with a batch of 1 added when forward, exported again with the
    batch dimensions cut to 1 (and the same dimensions ``fixed``), records the same graph
    (``fxopt.capture.export_guards``); else refusing a batch of 1, saying why."""
    result = list(constraints)
    for i, (exported, first) in enumerate(zip(exports, constraints)):
        if i and first == constraints[0] and same_program(
                exported.program, exports[0].program, first.specs, constraints[0].specs):
            result[i] = result[0]  # the eval graph is the train graph: so is its second trace
            continue
        group = batch_group(first, example)
        if not group:
            continue
        cut = cut_to_one(example, group)
        try:
            at_one = _export(shell, call, cut, "oblivious", i == 0, fixed, traced)
        except Exception as error:  # noqa: BLE001 - batch 1 is then refused, saying why
            why = (f"torch.export could not trace forward at a batch of 1: "
                   f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            result[i] = without_batch_of_one(first, group, why)
            continue
        second = constraints_of(at_one.program, cut)
        if second is not None and same_program(exported.program, at_one.program,
                                               first.specs, second.specs, group):
            result[i] = with_batch_of_one(first, second, group)
        else:
            result[i] = without_batch_of_one(first, group, (
                "forward treats a batch of 1 apart: a second trace at batch 1 recorded a "
                "different graph" if second is not None else "a second trace at batch 1 "
                "recorded conditions on sizes fxopt cannot check"))
    return result, all(r.batch_of_one for r in result)


def _propagate(model: nn.Module, gm: fx.GraphModule, placeholders: list[Placeholder],
               arguments: dict[str, Any], *, record: bool = True) -> None:
    values = tuple(arguments[p.name] if p.name in arguments else p.default for p in placeholders)
    # export itself ran the model on these inputs: a failure here is fxopt's
    propagate_meta_explained(model, gm, values, model_runs=True,
                             hint="capture it with capture='fx', or report this model to fxopt")
    if record:  # opaque leaves: run for real on the example inputs, replayed on fakes
        record_leaf_runs(gm, values)
