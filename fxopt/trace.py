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

Not handled: keyword-only example inputs and dict inputs (pass positional tensors), and models
whose forward reads module attributes that are not registered submodules.
"""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxopt.errors import InputError, TraceError
from fxopt.meta import propagate_meta
from fxopt.step import as_args

_TORCH_DIR = str(Path(torch.__file__).parent)


@dataclass(frozen=True)
class LeafFallback:
    """A submodule kept as an opaque call because torch.fx could not trace through it."""

    path: str
    module_type: str
    reason: str


@dataclass
class TraceInfo:
    leaves: list[LeafFallback] = field(default_factory=list)
    seconds: float = 0.0


def structural_copy(model: nn.Module) -> nn.Module:
    """New module objects all the way down, sharing the user's Parameter and buffer tensors.

    A module used twice in the tree is copied once, so sharing (and tied weights) survives.
    """
    memo: dict[int, nn.Module] = {}

    def copy_module(module: nn.Module) -> nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        new = copy.copy(module)
        memo[id(module)] = new
        for attr in ("_parameters", "_buffers", "_non_persistent_buffers_set",
                     "_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            if attr in module.__dict__:
                new.__dict__[attr] = copy.copy(module.__dict__[attr])
        new.__dict__["_modules"] = {
            name: None if child is None else copy_module(child)
            for name, child in module._modules.items()
        }
        return new

    return copy_module(model)


class _FallbackTracer(fx.Tracer):
    """A tracer that treats ``forced_leaves`` as leaves and remembers the innermost failing module."""

    def __init__(self, forced_leaves: set[str]):
        super().__init__()
        self.forced_leaves = forced_leaves
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.forced_leaves or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:
            if not hasattr(error, "_fxopt_failed_module"):
                error._fxopt_failed_module = self.path_of_module(m)  # type: ignore[attr-defined]
            raise


def _user_frame(error: BaseException) -> str:
    """The innermost traceback frame outside torch: where in the user's code tracing failed."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(_TORCH_DIR) and "/fxopt/" not in f.filename]
    if not frames:
        return "unknown source line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _check_inputs(model: Any, example_inputs: Any) -> tuple:
    if not isinstance(model, nn.Module):
        raise InputError(
            f"fxopt needs a torch.nn.Module, got {type(model).__name__}",
            hint="pass the model object itself (e.g. fxopt.optimize(MyNet(), inputs)).",
        )
    args = as_args(example_inputs)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        kinds = ", ".join(type(a).__name__ for a in args) or "nothing"
        raise InputError(
            f"example inputs must be a tensor or a tuple of tensors, got ({kinds})",
            hint="pass the positional tensors forward() takes, e.g. (torch.randn(8, 3, 224, 224),).",
        )
    return args


def _fetch(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def graph_module_like(shell: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule whose module tree *is* ``shell``'s, so state_dict keys and order match.

    fx would otherwise copy only the attributes the graph uses (dropping unused parameters, and
    modules only reached through a checkpointed region) and register tracer constants as buffers
    (adding state_dict keys). Plain attributes the graph reads stay plain attributes.
    """
    gm = fx.GraphModule(shell, graph, class_name=type(shell).__name__)
    constants = {n.target: _fetch(gm, n.target) for n in graph.nodes if n.op == "get_attr"}
    gm._modules.clear()
    gm._modules.update(shell._modules)
    gm._parameters = copy.copy(shell._parameters)
    gm._buffers = copy.copy(shell._buffers)
    gm._non_persistent_buffers_set = set(shell._non_persistent_buffers_set)
    for target, value in constants.items():
        owner_path, _, name = target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        if not hasattr(owner, name):
            # A tracer-made constant: a plain attribute, not a buffer, so not in state_dict.
            object.__setattr__(owner, name, value)
    gm.training = shell.training  # submodules keep their own flags (a frozen BN stays in eval)
    return gm


def trace(model: nn.Module, example_inputs: Any, *, leaf_modules: tuple[str, ...] = ()) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule whose nodes carry ``meta["val"]`` (fake tensors).

    ``leaf_modules`` names submodules (qualified paths) to keep opaque from the start. The
    returned module's ``meta["fxopt_trace"]`` is a TraceInfo listing every leaf fallback.
    """
    args = _check_inputs(model, example_inputs)
    start = time.perf_counter()
    forced = set(leaf_modules)
    info = TraceInfo()
    while True:
        shell = structural_copy(model)  # fresh each attempt: a failed trace leaves constants behind
        tracer = _FallbackTracer(forced)
        try:
            graph = tracer.trace(shell)
            break
        except Exception as error:  # torch.fx raises many types; we re-raise all as TraceError
            path = getattr(error, "_fxopt_failed_module", "")
            if not path or path in forced:
                raise TraceError(
                    f"torch.fx cannot trace {type(model).__name__}.forward: "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                    where=f"{path or '<root>'} at {_user_frame(error)}",
                    hint="move data-dependent Python control flow (if/for on tensor values, "
                    "int(tensor), iterating a tensor) into a submodule, which fxopt then keeps "
                    "as an opaque leaf, or pass leaf_modules=(...) naming it.",
                ) from error
            forced.add(path)
            info.leaves.append(LeafFallback(
                path, type(shell.get_submodule(path)).__name__,
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
                f"({_user_frame(error)})",
            ))
    gm = graph_module_like(shell, graph)
    propagate_meta(gm, args)
    info.seconds = time.perf_counter() - start
    gm.meta["fxopt_trace"] = info
    return gm
