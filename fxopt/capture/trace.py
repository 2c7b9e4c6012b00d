"""Capture a model as a torch.fx GraphModule without touching the user's model.

``trace(model, example_inputs)`` symbolically traces a *structural copy* of the model: every
module object is new, but parameters and buffers are the user's own tensors. So a pass may flip a
module flag (``inplace=True``) without the user's model seeing it, while an optimizer built on the
optimized module still trains the user's Parameters, and ``state_dict()`` keys, order and shapes are
exactly the original's.

Submodules that torch.fx cannot trace (data-dependent control flow, ``int(proxy)``, iteration over
a proxy, ...) are kept as opaque leaf calls: the tracer retries with the innermost failing module
as a leaf until the trace succeeds, and records each fallback with its reason. Only when the root's
own ``forward`` cannot be traced does it raise ``TraceError``.

Hooks (``fxopt.core.modules.has_hooks``) registered before ``trace`` keep firing on the traced
module, where the user's model would fire them: a submodule with hooks is kept as a leaf call
(recorded in ``TraceInfo.leaves``; traced through, its hooks would run once at trace time, on
proxies), and the root's hooks are copied onto the GraphModule. They also fire whenever fxopt
itself runs the module (meta propagation, verification, measurement). Hooks registered on the
user's model afterwards do not reach the traced module, nor the other way round. Process-wide
module hooks (``torch.nn.modules.module.register_module_forward_hook`` & co.) fire only for the
module calls left in the graph.

Example inputs are forward's positional arguments: a tensor, or a tuple/list of them, where an
argument may also be a tuple, list or dict of tensors, or a plain value (None, bool, int, float,
str). Plain values and the parameters left out at the end (which take their defaults) are
specialised: the traced module asserts it gets the same value. A bare dict is refused as
ambiguous (see ``check_inputs``).

Code that depends on ``self.training`` is traced in both modes: see ``fxopt.graph.train_eval``.
A model whose forward returns an ``OrderedDict`` returns one from the traced module too.

Not handled: keyword-only arguments without defaults, and models whose forward reads module
attributes that are not registered submodules.
"""

from __future__ import annotations

import collections
import dataclasses
import linecache
import operator
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxopt.capture.leaf_recording import record_leaf_runs
from fxopt.capture.trace_checks import (
    check_state_kept,
    is_user_file,
    propagate_meta_explained,
    in_words,
    root_failure_hint,
    user_checkpoints_refused,
    user_frame,
)
from fxopt.graph.graphs import graph_module_like
from fxopt.graph.pickling import ReloadTracer, refuse_pickling
from fxopt.graph.train_eval import install_eval_graph, modules_the_mode_changes, same_graph
from fxopt.core import meta_keys
from fxopt.core.errors import TraceError
from fxopt.core.inputs import check_inputs, concrete_args
from fxopt.core.modules import call_hooks, has_hooks, structural_copy
from fxopt.runtime.chunked_loss import CHUNKED_LOSS_CALLS
from fxopt.runtime.chunked_mlp import chunked_mlp
from fxopt.runtime.embedding_rows import embedding_rows
from fxopt.runtime.devices import on_device, tensor_device
from fxopt.runtime.input_guard import InputGuard, guard_inputs
from fxopt.runtime.regions import CheckpointedRegion, call_region, region_inputs
from fxopt.runtime.scoped import autocast_scope, grad_mode_scope


@dataclass(frozen=True)
class LeafFallback:
    """A submodule kept as an opaque call: torch.fx could not trace through it, or it has hooks."""

    path: str
    module_type: str
    reason: str


@dataclass
class TraceInfo:
    """How a model was captured: ``meta["fxopt_trace"]`` of a captured GraphModule.

    ``frontend`` is the capture frontend that made the graph ("fx": symbolic tracing, this
    module; "export": ``fxopt.capture.export_frontend``) and ``not_used`` says, as (frontend,
    one line) pairs, why the others did not (``fxopt.capture.chain``). Fields added later have
    class-level defaults, so a TraceInfo pickled before they existed loads with them.
    """

    leaves: list[LeafFallback] = field(default_factory=list)
    seconds: float = 0.0
    # True when forward's Python code depends on self.training (see fxopt.graph.train_eval)
    mode_dependent: bool = False
    # the modules whose operations differ between the two modes (modules_the_mode_changes)
    mode_dependent_modules: tuple[str, ...] = ()
    frontend: str = "fx"
    not_used: tuple[tuple[str, str], ...] = ()
    # one line per opaque leaf measured on a real run (fxopt.analysis.leaf_runs.leaf_lines)
    leaf_runs: tuple[str, ...] = ()
    # True on a copy of a capture made once by fxopt.capture_model (fxopt.capture.reuse)
    reused: bool = False
    # times the frontend that made the graph traced forward (fx: train and eval mode per
    # attempt; export: every torch.export trace); 0 where not counted
    traces: int = 0
    # export: which input sizes the module serves (``ExportInfo.describe_sizes``); fx: ""
    sizes: str = ""


class _FallbackTracer(ReloadTracer):
    """A tracer that treats ``forced_leaves`` as leaves and remembers the innermost failing module.

    Constructible without arguments: ``torch.load`` re-traces a saved GraphModule with its tracer
    class (every submodule a leaf), so an optimized module saved with ``torch.save`` loads back."""

    def __init__(self, forced_leaves: frozenset[str] | set[str] = frozenset()):
        # A graph fxopt already checkpointed calls call_region(self._fxopt_region_0, ...) on a
        # region_inputs(...) list, one with a chunked loss calls its autograd function, and one
        # captured by export may call a grad-mode or autocast scope: recorded as those calls,
        # not traced through (which would drop the checkpointing, the loss's own backward or
        # the scope).
        super().__init__(autowrap_functions=(call_region, region_inputs, guard_inputs,
                                             grad_mode_scope, autocast_scope, tensor_device,
                                             on_device,
                                             embedding_rows, chunked_mlp, *CHUNKED_LOSS_CALLS))
        self.forced_leaves = forced_leaves
        self.hooked: dict[str, nn.Module] = {}  # path -> module made a leaf for its hooks
        # Each node's stack trace is recorded by create_node below, not by fx (which formats
        # every frame of every node's stack: a third of a large CNN's capture).
        self.record_stack_traces = False
        self._user_files: dict[str, bool] = {}
        # Buffers as graph values too (fx proxies only parameters by default): otherwise an
        # in-place update in forward (self.count.add_(1)) runs once, eagerly, on the user's
        # buffer while tracing, and is missing from the graph.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.forced_leaves or super().is_leaf_module(
                m, module_qualified_name):
            return True
        if has_hooks(m):
            # Traced through, its hooks would run once now, on proxies, and never again.
            self.hooked[module_qualified_name] = m
            return True
        return False

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if not self._installed(m):
            # Built inside forward (``nn.ReLU()(x)``, as DistilBERT's classifier does): not part
            # of the model's state, so its body is traced in place, as a function would be.
            return forward(*args, **kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:
            if not hasattr(error, "_fxopt_failed_module"):
                error._fxopt_failed_module = self.path_of_module(m)  # type: ignore[attr-defined]
            raise

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not node.stack_trace:
            node.stack_trace = self._user_stack()
        return node

    def _user_stack(self) -> str | None:
        """The user's frames (``is_user_file``: outside torch and fxopt) of the stack from the
        outermost ``forward`` in, formatted as fx formats a recorded stack trace, or None. What
        errors and lints read of a node's stack trace is its innermost user frame, which this
        keeps, without fx's formatting of every other frame."""
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        outermost = next((i for i in range(len(frames) - 1, -1, -1)
                          if frames[i].f_code.co_name == "forward"), None)
        if outermost is None:
            return None
        kept = []
        for frame in reversed(frames[:outermost + 1]):
            path = frame.f_code.co_filename
            if path not in self._user_files:
                self._user_files[path] = is_user_file(path)
            if self._user_files[path]:
                kept.append((path, frame.f_lineno, frame.f_code.co_name,
                             linecache.getline(path, frame.f_lineno).strip()))
        return "".join(traceback.StackSummary.from_list(kept).format()).strip() or None

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """fx's ``Tracer.getattr`` (a read of a Parameter, or of a buffer, becomes a ``get_attr``
        node named by its first path), with the model's tensors found in an index by identity:
        fx walks the whole module tree for every tensor read, quadratic in the model's size (24
        of the 39 s timm's GhostNetV3 took to capture). A tensor the index does not hold (one
        registered while forward runs) takes fx's own search."""
        if not isinstance(attr_val, torch.Tensor) or self.param_shapes_constant:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        parameters, buffers = self._tensor_paths()
        name = parameters.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None and self.proxy_buffer_attributes:
            name = buffers.get(id(attr_val))
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def _tensor_paths(self) -> tuple[dict[int, str], dict[int, str]]:
        """id -> first path of the root's Parameters and of its buffers, as fx's search finds
        them (``named_parameters()``, ``named_buffers()``), built once per root."""
        if getattr(self, "_paths_of", None) is not self.root:
            self._paths_of = self.root
            self._paths = tuple({id(t): name for name, t in named()}  # each tensor once
                                for named in (self.root.named_parameters,
                                              self.root.named_buffers))
        return self._paths

    def _installed(self, m: nn.Module) -> bool:
        if not hasattr(self, "_module_ids"):
            self._module_ids = {id(module) for module in self.root.modules()}
        return id(m) in self._module_ids

    def create_arg(self, a: Any) -> Any:
        # fx records every dict as a plain dict; keep OrderedDict (torchvision's segmentation
        # models and FPN backbones return one) and its subclasses the way fx keeps dataclasses:
        # as a constructor call. Hugging Face's ModelOutput and diffusers' BaseOutput are both
        # an OrderedDict and a dataclass: rebuilt from their fields, as the model built them.
        if isinstance(a, collections.OrderedDict) and dataclasses.is_dataclass(a):
            return self.create_node("call_function", type(a), (),
                                    {k: super(_FallbackTracer, self).create_arg(v)
                                     for k, v in a.items()})
        if isinstance(a, collections.OrderedDict):
            return self.create_node("call_function", type(a),
                                    (super().create_arg(dict(a)),), {})
        return super().create_arg(a)  # fxopt's plain attributes: ReloadTracer


def _trace_both_modes(shell: nn.Module, forced: set[str], concrete: dict[str, Any],
                      hooked: dict[str, nn.Module], info: TraceInfo) -> tuple[fx.Graph, fx.Graph]:
    """Trace ``shell`` with every module in train mode, then in eval mode (flags restored).

    ``hooked`` receives the modules kept as leaves for their hooks; ``info.traces`` counts the
    traces."""
    flags = [(m, m.training) for m in shell.modules()]
    try:
        graphs = []
        with user_checkpoints_refused():
            for training in (True, False):
                shell.train(training)
                tracer = _FallbackTracer(forced)
                info.traces += 1
                graphs.append(tracer.trace(shell, concrete_args=concrete or None))
                hooked.update(tracer.hooked)
        return graphs[0], graphs[1]
    finally:
        for module, flag in flags:
            module.training = flag


def trace(model: nn.Module, example_inputs: Any, *, leaf_modules: tuple[str, ...] = (),
          example_kwargs: dict[str, Any] | None = None) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule whose nodes carry ``meta["val"]`` (fake tensors).

    ``leaf_modules`` names submodules (qualified paths) to keep opaque from the start. The
    returned module's ``meta["fxopt_trace"]`` is a TraceInfo listing every leaf fallback.
    """
    args = check_inputs(model, example_inputs, example_kwargs)
    concrete = concrete_args(model, args)
    start = time.perf_counter()
    forced = set(leaf_modules)
    info = TraceInfo()
    while True:
        shell = structural_copy(model)  # fresh each attempt: a failed trace leaves constants behind
        hooked: dict[str, nn.Module] = {}
        try:
            graph, eval_graph = _trace_both_modes(shell, forced, concrete, hooked, info)
            break
        except Exception as error:  # torch.fx raises many types; we re-raise all as TraceError
            path = getattr(error, "_fxopt_failed_module", "")
            if not path or path in forced:
                raise TraceError(
                    f"torch.fx cannot trace {type(model).__name__}.forward: {in_words(error)}",
                    where=f"{path or '<root>'} at {user_frame(error)}",
                    hint=root_failure_hint(error, model),
                ) from error
            forced.add(path)
            info.leaves.append(LeafFallback(
                path, type(shell.get_submodule(path)).__name__,
                f"{in_words(error)} ({user_frame(error)})",
            ))
    info.leaves.extend(
        LeafFallback(path, type(module).__name__,
                     f"has {' and '.join(call_hooks(module))}: kept as a call so they run")
        for path, module in hooked.items())
    check_state_kept(model, shell)
    gm = graph_module_like(shell, graph)
    if not same_graph(graph, eval_graph, shell):
        _attach_constants(gm, shell, eval_graph)
        install_eval_graph(gm, eval_graph)
        refuse_pickling(gm)
        info.mode_dependent = True
        info.mode_dependent_modules = modules_the_mode_changes(graph, eval_graph)
    propagate_meta_explained(model, gm, args)
    record_leaf_runs(gm, args)  # leaves that cannot run on fakes: measured on a real run
    info.seconds = time.perf_counter() - start
    gm.meta[meta_keys.TRACE] = info
    return gm


def _attach_constants(gm: fx.GraphModule, shell: nn.Module, graph: fx.Graph) -> None:
    """Tracer-made constants ``graph`` reads, as plain attributes of ``gm`` (not state)."""
    for node in graph.nodes:
        if node.op == "get_attr" and not _has_path(gm, node.target):
            owner_path, _, name = node.target.rpartition(".")
            value = operator.attrgetter(node.target)(shell)
            object.__setattr__(gm.get_submodule(owner_path), name, value)


def _has_path(module: nn.Module, target: str) -> bool:
    try:
        operator.attrgetter(target)(module)
        return True
    except AttributeError:
        return False
