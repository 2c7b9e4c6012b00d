"""Opaque leaves under torch.export: a submodule export cannot follow becomes one module call.

torch.export runs ``forward`` on fake tensors and stops at code that reads tensor values: an
eager mixture-of-experts loop (``for expert in mask.nonzero(): ...``, OLMoE's experts in
transformers), ``if x.mean() > 0``. When such code sits in a submodule, the rest of the model
can still be exported: ``OpaqueLeaves(shell, paths)`` runs the model once for real to record
each leaf's calls (``fxopt.graph.leaf_tape.recorded_call``), and while export runs
(``exporting()``) each leaf's forward is one call of the custom operator
``fxopt::opaque_leaf(key, tensors) -> tensors``, whose fake implementation returns outputs laid
out like the recorded ones (a size equal to one of the inputs' sizes is that input's size, so
dynamic sizes stay dynamic). After unlifting, ``restore_calls(graph)`` turns each such operator
call back into ``call_module(path, args, kwargs)`` on the leaf itself, so the captured module
calls the submodule as written (its parameters the user's, its Python run eagerly) and fxopt
treats it as any opaque leaf: run for real on the example inputs and replayed on fakes
(``fxopt.capture.leaf_recording``), checkpointed whole or around.

``failing_submodule(shell, error)`` finds, in a failed export's traceback, the innermost
submodule whose forward was running: the one to keep opaque.

When it is safe: the leaf's outputs' shapes depend on its inputs' shapes only as recorded (an
output size that equals no input size is fixed at the recorded value; a guard on the captured
module refuses other input sizes only where export recorded one). Not handled: leaves whose
arguments are not tensors, plain values and containers of them; outputs other than a tensor
or (nested) tuples, lists and dicts of tensors; a leaf that returns one of its inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxopt.graph.leaf_tape import (
    LeafCall,
    TensorSpec,
    forwards_patched,
    moved_device,
    recorded_call,
)
from fxopt.core.errors import TraceError
from fxopt.core.torch_private import tree_flatten, tree_flatten_with_path, tree_unflatten


@dataclass
class _Leaf:
    """One opaque leaf during an export: its module, path and the calls recorded for real."""

    module: nn.Module
    path: str
    calls: list[tuple[Any, LeafCall]] = field(default_factory=list)  # (argument spec, call)
    turn: int = 0


_LEAVES: dict[str, _Leaf] = {}  # key -> leaf, while an export that uses them runs
_KEYS = itertools.count()


@torch.library.custom_op("fxopt::opaque_leaf", mutates_args=())
def opaque_leaf(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call of an opaque leaf (``key`` names it); run for real, it calls the leaf."""
    leaf, index = _split(key)
    spec, _ = leaf.calls[index]
    args, kwargs = _rebuilt(spec, inputs)
    out = type(leaf.module).forward(leaf.module, *args, **kwargs)
    return [t.clone() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


@opaque_leaf.register_fake
def _opaque_leaf_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    leaf, index = _split(key)
    _, call = leaf.calls[index]
    real_sizes = [size for shape, _ in call.key[1] for size in shape]
    sizes: dict[int, Any] = {}
    for real, fake in zip(real_sizes, (s for t in inputs for s in t.shape)):
        if real not in (0, 1):  # a 0 or 1 that happens to match ties nothing
            sizes.setdefault(real, fake)
    # each output on its recorded device (a leaf with no tensor input, a position-id builder,
    # makes its outputs where the model is), or where the leaf is if it moved since
    moved = call.moves(leaf.module, inputs, None)
    return [torch.empty([sizes.get(n, n) for n in spec.shape], dtype=spec.dtype,
                        device=moved_device(spec.device, moved))
            for spec in _tensor_specs(call.outputs)]


def _split(key: str) -> tuple[_Leaf, int]:
    name, _, index = key.rpartition("#")
    return _LEAVES[name], int(index)


def _tensor_specs(outputs: Any) -> list[TensorSpec]:
    return [s for s in tree_flatten(outputs)[0] if isinstance(s, TensorSpec)]


_TENSOR = object()  # a tensor's place in a recorded call's arguments


def _argument_spec(args: tuple, kwargs: dict) -> tuple[Any, list[torch.Tensor]]:
    """(the call's structure with its tensors' places marked, its tensors in order)."""
    flat, spec = tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    return (spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]), tensors


def _rebuilt(spec: Any, tensors: list[Any]) -> tuple[tuple, dict]:
    """The call's ``(args, kwargs)`` with ``tensors`` in the tensors' places."""
    tree, flat = spec
    values = iter(tensors)
    return tree_unflatten([next(values) if x is _TENSOR else x for x in flat], tree)


class OpaqueLeaves:
    """The leaves of one export: recorded for real, exported as ``fxopt::opaque_leaf`` calls,
    restored as module calls (see the module doc)."""

    def __init__(self, shell: nn.Module, paths: tuple[str, ...], run_for_real: Any):
        self.shell = shell
        self.prefix = f"fxopt_leaf_{next(_KEYS)}_"
        self.leaves: dict[str, _Leaf] = {}
        for path in paths:
            try:
                module = shell.get_submodule(path)
            except AttributeError:
                raise TraceError(f"leaf_modules names {path!r}, which is no submodule of "
                                 f"{type(shell).__name__}", where="leaf_modules",
                                 hint="give module paths as model.named_modules() lists them")
            self.leaves[self.prefix + path.replace(".", "_")] = _Leaf(module, path)
        self._record(run_for_real)

    def _record(self, run_for_real: Any) -> None:
        def recording(leaf: _Leaf) -> Any:
            original = leaf.module.forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                spec, _ = _argument_spec(args, kwargs)
                out, call = recorded_call(leaf.module, original, args, kwargs)
                leaf.calls.append((spec, call))
                return out

            return forward

        with forwards_patched([(leaf.module, recording(leaf)) for leaf in self.leaves.values()]):
            run_for_real()
        missing = [leaf.path for leaf in self.leaves.values() if not leaf.calls]
        if missing:
            raise TraceError(f"leaf_modules names {missing[0]!r}, which forward never calls",
                             where="leaf_modules", hint="name only modules forward calls")

    def _exporting_forward(self, name: str, leaf: _Leaf) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            index = leaf.turn % len(leaf.calls)
            leaf.turn += 1
            _, tensors = _argument_spec(args, kwargs)
            outs = iter(opaque_leaf(f"{name}#{index}", tensors))
            _, call = leaf.calls[index]
            leaves, spec = tree_flatten(call.outputs)
            return tree_unflatten([next(outs) if isinstance(s, TensorSpec) else s
                                   for s in leaves], spec)

        return forward

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """Inside: each leaf's forward is one ``fxopt::opaque_leaf`` call."""
        _LEAVES.update(self.leaves)
        for leaf in self.leaves.values():
            leaf.turn = 0
        try:
            with forwards_patched([(leaf.module, self._exporting_forward(name, leaf))
                                   for name, leaf in self.leaves.items()]):
                yield
        finally:
            for name in self.leaves:
                _LEAVES.pop(name, None)

    def restore_calls(self, graph: fx.Graph) -> None:
        """Turn every ``fxopt::opaque_leaf`` call of ``graph`` into a call of its module."""
        for node in list(graph.find_nodes(op="call_function",
                                          target=torch.ops.fxopt.opaque_leaf.default)):
            name, _, index = node.args[0].rpartition("#")
            leaf = self.leaves[name]
            spec, call = leaf.calls[int(index)]
            args, kwargs = _rebuilt(spec, list(node.args[1]))
            with graph.inserting_before(node):
                module_call = graph.call_module(leaf.path, tuple(args), dict(kwargs))
            module_call.meta.update(node.meta)
            module_call.meta.pop("val", None)
            _reroute_outputs(graph, node, module_call, call.outputs)
            graph.erase_node(node)


def _reroute_outputs(graph: fx.Graph, op: fx.Node, module_call: fx.Node, outputs: Any) -> None:
    """Users of ``op``'s i-th tensor (``getitem(op, i)``) read the same tensor off the module
    call's own output structure instead."""
    paths = [path for path, s in tree_flatten_with_path(outputs)[0] if isinstance(s, TensorSpec)]
    for user in list(op.users):
        if user.target is not operator.getitem:
            raise TraceError("an opaque leaf's outputs are used as a list, which fxopt cannot "
                             "restore", where=str(user), hint="report this model to fxopt")
        value = module_call
        with graph.inserting_before(user):
            for entry in paths[user.args[1]]:
                key = getattr(entry, "idx", getattr(entry, "key", None))
                value = graph.call_function(operator.getitem, (value, key))
        user.replace_all_uses_with(value)
        graph.erase_node(user)


def failing_submodule(shell: nn.Module, error: BaseException) -> str | None:
    """The path of the innermost submodule of ``shell`` (not ``shell`` itself) whose forward
    was running where ``error`` (or an exception it was raised from) was raised, or None."""
    paths = {id(m): path for path, m in shell.named_modules() if path}
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = None
        for frame, _ in traceback.walk_tb(error.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in paths:
                found = paths[id(owner)]
        if found is not None:
            return found
        error = error.__cause__ or error.__context__
    return None


def same_kind(shell: nn.Module, path: str) -> tuple[str, ...]:
    """``path`` and every other submodule of the same class (the same code fails the same way):
    the other layers' experts of a mixture-of-experts model."""
    kind = type(shell.get_submodule(path))
    return tuple(p for p, m in shell.named_modules() if p and type(m) is kind)


MAX_ROUNDS = 4  # exports tried, each keeping the submodules the one before failed in


def _data_dependent(error: BaseException) -> bool:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__}: {error}"
        if "DataDependent" in text or "data-dependent" in text or "data dependent" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


def exported_keeping_leaves(shell: nn.Module, paths: tuple[str, ...], run_for_real: Any,
                            export: Any, *, find_more: bool = True
                            ) -> tuple[Any, OpaqueLeaves | None, list[tuple[str, str]]]:
    """``export()``'s result with the submodules ``paths`` kept opaque and, with ``find_more``,
    when export fails on data-dependent code in a submodule, that submodule and every other of
    its class kept opaque too (a few rounds at most). Returns the result, the leaves (None
    without any) and (path, why) for each leaf found that way."""
    found: list[tuple[str, str]] = []
    for _ in range(MAX_ROUNDS):
        opaque = OpaqueLeaves(shell, paths, run_for_real) if paths else None
        try:
            with opaque.exporting() if opaque is not None else contextlib.nullcontext():
                return export(), opaque, found
        except TraceError as error:
            path = (failing_submodule(shell, error) if find_more and _data_dependent(error)
                    else None)
            if path is None or path in paths:
                raise
            why = f"torch.export cannot follow it: {error.what.splitlines()[0]}"
            added = [p for p in same_kind(shell, path) if p not in paths]
            found += [(p, why) for p in added]
            paths = (*paths, *added)
    raise TraceError(f"torch.export still fails after keeping {len(paths)} submodules opaque",
                     where=", ".join(paths[:4]), hint="name the submodules to keep opaque "
                     "in leaf_modules=(...), or report this model to fxopt")
