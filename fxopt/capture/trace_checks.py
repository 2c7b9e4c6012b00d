"""What tracing refuses, and how its failures are told to the user.

- A forward that calls ``torch.utils.checkpoint`` would be traced *through*, silently dropping
  the recomputation the user asked for: inside ``user_checkpoints_refused`` that raises
  ``UserCheckpoint``, so the calling module becomes an opaque leaf that keeps it as written.
- A forward that *assigns* a parameter or buffer runs once, eagerly, while tracing, and the
  graph loses the update: ``check_state_kept`` raises ``TraceError`` naming it.
- Shape propagation that fails is the model's fault (``InputError``: it does not run on these
  inputs) or fxopt's (``TraceError``: an op without a fake kernel): ``propagate_meta_explained``
  tells which by running the model once for real, only on that failure path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import fx, nn

from fxopt.graph.meta import propagate_meta
from fxopt.core.errors import FxoptError, InputError, TraceError
from fxopt.core.modules import own_tensors
from fxopt.core.state import preserved_state
from fxopt.core.torch_private import checkpoint_calls_refused

# The packages whose frames are fxopt's machinery (``fxopt.passes`` lies beside ``fxopt/`` in a
# source tree). ``fxopt.models_zoo`` is not among them: its forwards are model code, whose lines
# a user wants named, even where it is installed inside fxopt's folder.
_OWN_PACKAGES = ("fxopt", "fxopt.passes")
_MODEL_PACKAGES = ("fxopt.models_zoo",)
_FRAME_LINE = re.compile(r'File "(?P<path>[^"]+)", line \d+')


def _package_dir(name: str) -> str | None:
    """The real directory of the package ``name`` (the one ``import name`` gives),
    with a trailing separator; None where it is not installed. Found without importing it."""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if file is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        file = spec.origin if spec is not None and spec.has_location else None
    return None if file is None else os.path.join(Path(file).resolve().parent, "")


@functools.cache
def _not_user_dirs() -> tuple[str, ...]:
    """torch's directory and those of fxopt's own packages, by where their modules really are:
    a folder *named* fxopt proves nothing (a clone of fxopt, or the user's own project, may be
    called that). The trailing separator keeps torchvision out of torch."""
    dirs = (_package_dir(name) for name in ("torch", *_OWN_PACKAGES))
    return tuple(d for d in dirs if d is not None)


@functools.cache
def _model_dirs() -> tuple[str, ...]:
    dirs = (_package_dir(name) for name in _MODEL_PACKAGES)
    return tuple(d for d in dirs if d is not None)


def is_user_file(filename: str) -> bool:
    """Whether a traceback frame's file is the user's: outside torch and fxopt's own packages.
    Generated code (``<eval_with_key>.3``, ``<string>``) counts as the user's, as before."""
    try:
        real = str(Path(filename).resolve())
    except (OSError, RuntimeError):
        real = os.path.abspath(filename)
    return real.startswith(_model_dirs()) or not real.startswith(_not_user_dirs())


def user_frame(error: BaseException) -> str:
    """The innermost traceback frame outside torch and fxopt: where in the user's code tracing
    failed."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return "unknown source line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def node_source(node: fx.Node) -> str:
    """The innermost user frame (outside torch and fxopt) of the node's recorded stack trace."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = [(line.strip(), lines[i + 1].strip() if i + 1 < len(lines) else "")
              for i, line in enumerate(lines) if line.strip().startswith("File ")]
    user = [f for f in frames
            if (path := _FRAME_LINE.match(f[0])) is None or is_user_file(path["path"])]
    if not user:
        return "unknown source line"
    return f"{user[-1][0]}: {user[-1][1]}"


class UserCheckpoint(Exception):
    """Raised while tracing when a forward calls ``torch.utils.checkpoint.checkpoint``."""


@contextlib.contextmanager
def user_checkpoints_refused() -> Iterator[None]:
    """Inside: running ``torch.utils.checkpoint`` raises ``UserCheckpoint``.

    Tracing through a user's checkpoint would inline its function and silently drop the
    recomputation the user asked for; refusing it makes the calling module an opaque leaf,
    which keeps the checkpoint exactly as written. Both variants are caught where
    ``checkpoint()`` dispatches (``fxopt.core.torch_private.checkpoint_calls_refused``), in the
    tracing thread only: another thread checkpointing meanwhile is left alone. On a torch
    without those entry points the checkpoint is traced through as before.
    """
    def refuse() -> None:
        raise UserCheckpoint("calls torch.utils.checkpoint, which fxopt keeps as written")

    with checkpoint_calls_refused(refuse):
        yield


def has_checkpointed_regions(model: nn.Module) -> bool:
    graph = getattr(model, "graph", None)
    return isinstance(graph, fx.Graph) and any(
        getattr(n.target, "__name__", "") == "call_region" for n in graph.nodes)


_RELATIONS = {"Eq": "==", "Ne": "!=", "Lt": "<", "Le": "<=", "Gt": ">", "Ge": ">="}
_GUARD = re.compile(r"\b(Eq|Ne|Lt|Le|Gt|Ge)\(\s*([us]\d+)\s*,\s*([^()]+?)\s*\)")


def in_words(error: BaseException) -> str:
    """``Type: first line`` of a torch error, with torch's internals said in words: symbolic
    tracing's ``co_varnames is too small`` (a forward wrapped in a ``*args, **kwargs``
    decorator), and torch.export's guards on data-dependent symbols (``Eq(u0, 1)``, ``expression
    u0 (unhinted: u0)``: a value read from a tensor's data, compared with 1 or used as an int)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if "co_varnames" in first:
        return ("forward is wrapped in a decorator taking (*args, **kwargs), whose signature "
                "symbolic tracing cannot rebuild")
    if ("data-dependent" in first or "data dependent" in first
            or "DataDependent" in type(error).__name__):
        guard = _GUARD.search(first)
        if guard:
            relation, symbol, other = guard.groups()
            what = f"compares a value read from a tensor's data ({_RELATIONS[relation]} {other})"
        else:
            what = "reads a value from a tensor's data (.item(), int(tensor), if tensor)"
        return (f"forward {what} and uses it where a graph needs it fixed: which code runs "
                "depends on the data")
    return f"{type(error).__name__}: {first}"


def root_failure_hint(error: BaseException, model: nn.Module) -> str:
    """What to do when the root's own forward cannot be traced."""
    if isinstance(error, UserCheckpoint) and has_checkpointed_regions(model):
        return ("this module was already optimized by fxopt with checkpointed regions, which "
                "cannot be traced again yet: optimize the original model instead.")
    if isinstance(error, UserCheckpoint):
        return ("move the torch.utils.checkpoint call into a submodule's forward (fxopt keeps "
                "that submodule as written), or drop it and pass memory_budget= to let fxopt "
                "plan the recomputation.")
    if "co_varnames" in str(error):
        return ("forward is wrapped in a decorator taking (*args, **kwargs), which symbolic "
                "tracing cannot rebuild (Hugging Face models are): capture it with "
                "capture='export' (capture='auto', the default, tries it).")
    return ("move data-dependent Python control flow (if/for on tensor values, int(tensor), "
            "iterating a tensor) into a submodule, which fxopt then keeps as an opaque leaf, or "
            "pass leaf_modules=(...) naming it.")


def check_state_kept(model: nn.Module, shell: nn.Module) -> None:
    """A forward that *assigns* a parameter or buffer (``self.count = self.count + 1``) runs
    once, eagerly, while tracing, and the graph loses the update: refuse it."""
    shell_modules = dict(shell.named_modules(remove_duplicate=False))
    for path, module in model.named_modules(remove_duplicate=False):
        copy_ = shell_modules.get(path)
        copied = own_tensors(copy_) if copy_ is not None else ({}, {})
        for kind, table, copied_table in zip(("parameter", "buffer"), own_tensors(module),
                                             copied):
            for name, tensor in table.items():
                if copy_ is None or copied_table.get(name) is not tensor:
                    qualified = f"{path}.{name}" if path else name
                    raise TraceError(
                        f"{type(model).__name__}'s forward assigns a new tensor to {kind} "
                        f"{qualified!r}; torch.fx records no assignment, so the optimized "
                        "module would never update it",
                        where=f"{type(module).__name__} ({path or '<root>'})",
                        hint=f"update it in place instead (self.{name}.add_(1), "
                        f"self.{name}.copy_(new_value)), or keep that module opaque with "
                        f"leaf_modules=({path!r},)" if path else
                        f"update it in place instead (self.{name}.add_(1), "
                        f"self.{name}.copy_(new_value))")


def propagate_meta_explained(model: nn.Module, gm: fx.GraphModule, args: tuple, *,
                             model_runs: bool | None = None, hint: str | None = None) -> None:
    """``propagate_meta``, with a failure turned into an error that says whose fault it is:
    fxopt's (``TraceError``, with ``hint``) when the model itself runs on the inputs, the
    user's (``InputError``) when it does not. ``model_runs=None`` asks by running the model's
    train-mode forward on ``args``."""
    try:
        propagate_meta(gm, args)
    except FxoptError:
        raise
    except Exception as error:
        node = getattr(error, "_fxopt_node", None)
        where = (f"node {node.name} ({node.op} {getattr(node.target, '__name__', node.target)})"
                 f" at {node_source(node)}" if node is not None else "shape propagation")
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if model_runs if model_runs is not None else runs_for_real(model, args):
            raise TraceError(
                f"fxopt could not compute shapes of {type(model).__name__} on fake tensors: "
                f"{type(error).__name__}: {first}", where=where,
                hint=hint or "the op has no fake-tensor (meta) kernel: keep the submodule that "
                "calls it opaque with leaf_modules=('path.to.module',)") from error
        raise InputError(
            f"{type(model).__name__} does not run on these example inputs: "
            f"{type(error).__name__}: {first}", where=where,
            hint="check that model(*example_inputs) runs in train mode without fxopt (some models "
            "need a minimum input size, or a batch of more than one for BatchNorm)") from error


def runs_for_real(model: nn.Module, args: tuple) -> bool:
    """Whether a train-mode forward of the user's model works (its state restored after)."""
    try:
        with preserved_state(model), torch.no_grad():
            model.train()
            model(*args)
        return True
    except Exception:
        return False
