"""What an opaque leaf did on a real run, and its replay on fake tensors.

A leaf (a submodule kept as one ``call_module``: symbolic tracing fell back on it, or the user
named it in ``leaf_modules=``) whose forward reads tensor values (``if x.mean() > 0``,
``torch.where(mask)``, ``.item()``) cannot run on fake tensors: the fake kernel of
``aten._local_scalar_dense`` or ``aten.nonzero`` has no value to give. ``LeafRecord`` holds, per
call of the leaf on a real run on the example inputs (``fxopt.capture.leaf_recording``), the output of
every ATen op it ran (shapes, strides and dtypes; plain values for scalars), in order per op and
line of model code that ran it.
``leaves_replayed(module)`` makes every recorded leaf of ``module`` run on fakes: its own forward
runs, and an op whose fake kernel fails is answered with what the same call of that op returned
on the real run (the n-th ``aten.nonzero`` a line of the leaf's code runs gets the n-th one that
line ran for real). So the leaf
takes the branches it took for real and allocates, saves for backward and frees what it did for
real, and every fake-tensor analysis (``estimate_peak``, saved tensors, the checkpoint planner,
shape propagation after a rewrite) sees the leaf as it is, recomputation included.

Records live on the leaf's node: ``node.meta["fxopt_leaf"]`` (copied with the node into
checkpointed region bodies, the eval-mode graph and kept blocks). A call is chosen by the
module's ``training`` flag and its inputs' shapes and dtypes; several calls with the same key (a
shared module) are replayed in turn.

When the replay does not go through (an op sequence that differs on fakes, a backward with no
fake kernel), ``LeafRecord.replays`` is False and the leaf is stood in for by an autograd
Function that allocates its recorded outputs, the peak and the saved bytes measured inside it on
the real run (``LeafRecord.memory``, from ``fxopt.analysis.leaf_runs``) and its inputs' and
parameters' gradients.

Devices: a record keeps the device each tensor was on and the device the call ran on (its
inputs', parameters' and buffers': ``home_device``). A replay or stand-in makes what was on
that device where the leaf and its inputs are at the call (a module moved from ``cuda:0`` to
``cuda:1`` replays on ``cuda:1``, fakes of another device on that device), and what was on
another device (a CPU scalar in a CUDA leaf) where it was. A stand-in's peak and saved bytes go
on its first recorded output's device, so a leaf fed integer ids only, or called without grad,
counts them on the model's device.

Not handled: inputs of other shapes than the example inputs' (a larger batch): the leaf was not
run for them, and a fake run raises ``InputError`` saying so. Answers that depend on random
draws made before the leaf (a dropout ahead of a router) are those of the one recorded run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxopt.graph.graphs import graphs_of
from fxopt.core import meta_keys
from fxopt.core.errors import InputError
from fxopt.core.tensors import device_of, tensors_in
from fxopt.core.torch_private import (
    TorchDispatchMode,
    tensor_version,
    tree_flatten,
    tree_map,
    tree_unflatten,
)

META_KEY = meta_keys.LEAF
Moves = dict  # a recorded device (str) -> the device it stands for now (``moves``)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's layout, enough to allocate one like it (storage size included)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_bytes: int
    dtype: torch.dtype
    device: str

    def build(self, moved: Moves | None = None) -> torch.Tensor:
        """A new tensor laid out like the recorded one (a fake one inside a FakeTensorMode), on
        the recorded device, or where ``moved`` says that device went (``moves``)."""
        device = moved_device(self.device, moved)
        itemsize = self.dtype.itemsize
        span = 0 if 0 in self.shape else 1 + sum((n - 1) * s
                                                 for n, s in zip(self.shape, self.stride))
        if self.offset == 0 and span * itemsize == self.storage_bytes:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        base = torch.empty(-(-self.storage_bytes // itemsize), dtype=self.dtype, device=device)
        return base.as_strided(self.shape, self.stride, self.offset)



def home_device(module: nn.Module, args: Any = (), kwargs: Any = None) -> torch.device:
    """The device a leaf call runs on: ``device_of`` its inputs, parameters and buffers (the
    first CUDA device among them, else the first tensor's)."""
    return device_of((tensors_in((args, kwargs)), list(module.parameters()),
                      list(module.buffers())))


def moves(home: str | None, now: torch.device) -> Moves:
    """How recorded devices map to devices now: the device a call ran on when it was recorded
    (``home``) is ``now``; every other recorded device (a CPU scalar in a CUDA leaf) stays."""
    return {} if home is None or torch.device(home) == now else {home: now}


def moved_device(recorded: str, moved: Moves | None) -> Any:
    return (moved or {}).get(recorded, recorded)


def spec_of(value: Any) -> Any:
    """``value`` with each tensor replaced by its TensorSpec; other leaves kept when they are
    plain numbers, bools, strings or None, else None."""
    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return TensorSpec(tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(),
                              leaf.untyped_storage().nbytes(), leaf.dtype, str(leaf.device))
        return leaf if isinstance(leaf, (int, float, bool, str, type(None))) else None

    return tree_map(one, value)


def built(spec: Any, moved: Moves | None = None) -> Any:
    """The value a spec describes, each TensorSpec built as a new tensor (on the device
    ``moved`` gives for its recorded one)."""
    return tree_map(lambda s: s.build(moved) if isinstance(s, TensorSpec) else s, spec)


def call_key(module: nn.Module, args: Any, kwargs: Any) -> tuple:
    """What tells the calls of a leaf apart: its training flag and its inputs' shapes/dtypes."""
    return (module.training,
            tuple((tuple(t.shape), t.dtype) for t in tensors_in((args, kwargs))))


@dataclass
class LeafCall:
    """One call of a leaf on the real run: its key, every op's outputs (by op, in call order),
    its outputs, which of its tensor inputs it wrote in place (positions among them), and the
    device it ran on (``home_device``; None in records made before it was kept)."""

    key: tuple
    answers: dict[str, list[Any]]
    outputs: Any
    writes_inputs: tuple[int, ...] = ()
    home: str | None = None

    def moves(self, module: nn.Module, args: Any, kwargs: Any) -> Moves:
        """Where this call's recorded devices are for a call of ``module`` on these inputs:
        the recorded home device is where the inputs and the module are now."""
        return moves(self.home, home_device(module, args, kwargs))


@dataclass
class LeafRecord:
    """``node.meta["fxopt_leaf"]``: the real run(s) of one leaf module on the example inputs.

    ``replays``: whether a fake run with these answers went through (else the stand-in is used).
    ``memory``: the figures measured inside the leaf (``fxopt.analysis.leaf_runs.LeafMemory``),
    once measured.
    """

    path: str
    module_type: str
    calls: list[LeafCall] = field(default_factory=list)
    replays: bool = False
    memory: Any = None

    def matching(self, key: tuple) -> list[LeafCall]:
        return [call for call in self.calls if call.key == key]

    @property
    def writes_inputs(self) -> bool:
        """Whether a recorded call wrote one of its tensor inputs in place."""
        return any(call.writes_inputs for call in self.calls)


_NOT_MODEL_CODE = (os.path.join(os.path.dirname(torch.__file__), ""),
                   os.path.join(os.path.dirname(os.path.dirname(__file__)), ""))


def _op_site(func: Any) -> str:
    """``op@file:line``: the op and the innermost line of model code (outside torch and fxopt)
    that ran it. Calls are counted per site, so an op that one side runs and the other does
    not (``F.one_hot`` checks its input's range with ``.item()`` on real tensors, not on fakes)
    does not shift the answers of the others."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_MODEL_CODE):
        frame = frame.f_back
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    return f"{func}@{where}"


class Recorder(TorchDispatchMode):
    """Records every op's outputs (their specs), by op and the model line that ran it, in
    call order."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[str, list[Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.answers.setdefault(_op_site(func), []).append(spec_of(out))
        return out


class _Replay(TorchDispatchMode):
    """Runs each op as is; one whose (fake) kernel fails gets the recorded output of the same
    call of that op from the same model line."""

    def __init__(self, call: LeafCall, moved: Moves | None = None) -> None:
        super().__init__()
        self.call = call
        self.moved = moved
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _op_site(func)
        index = self.seen.get(name, 0)
        self.seen[name] = index + 1
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            recorded = self.call.answers.get(name, [])
            if index >= len(recorded):
                raise
            return built(recorded[index], self.moved)


def recorded_call(module: nn.Module, original: Any, args: Any, kwargs: Any) -> tuple[Any, LeafCall]:
    """Run ``original(*args, **kwargs)`` (the module's forward, for real) recording a LeafCall."""
    inputs = tensors_in((args, kwargs))
    versions = [tensor_version(t) for t in inputs]
    key = call_key(module, args, kwargs)
    home = str(home_device(module, args, kwargs))
    with Recorder() as recorder:
        out = original(*args, **kwargs)
    written = tuple(i for i, (t, v) in enumerate(zip(inputs, versions)) if tensor_version(t) != v)
    return out, LeafCall(key, recorder.answers, spec_of(out), written, home)


class _StandIn(torch.autograd.Function):
    """Allocates a leaf's recorded outputs, and the peak and saved bytes measured inside it (on
    the device of its first recorded output, where the leaf's memory was: the module's device
    even for a leaf fed integer ids only, or called without grad); in backward, its inputs'
    and parameters' gradients."""

    @staticmethod
    def forward(ctx: Any, outputs: Any, peak: int, saved: int, device: Any, moved: Moves,
                *inputs: torch.Tensor) -> tuple:
        ctx.specs = [(t.shape, t.dtype, t.device) for t in inputs]
        if peak:
            torch.empty(peak, dtype=torch.uint8, device=device)  # dropped at once
        if saved:  # what the leaf saves for backward, seen by saved-tensor hooks too
            ctx.save_for_backward(torch.empty(saved, dtype=torch.uint8, device=device))
        return tuple(spec.build(moved) for spec in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None, None, *(torch.zeros(shape, dtype=dtype, device=device)
                                                for shape, dtype, device in ctx.specs))


def _stand_in(module: nn.Module, outputs_spec: Any, peak: int, saved: int,
              home: str | None) -> Any:
    """A forward that returns outputs like ``outputs_spec`` through ``_StandIn``, the specs'
    devices followed from ``home`` (the device the leaf ran on when they were recorded) to
    where the module and its inputs are at the call."""
    leaves, spec = tree_flatten(outputs_spec)
    tensors = [leaf for leaf in leaves if isinstance(leaf, TensorSpec)]

    def forward(*args: Any, **kwargs: Any) -> Any:
        now = home_device(module, args, kwargs)
        moved = moves(home, now)
        device = moved_device(tensors[0].device, moved) if tensors else now
        inputs = tensors_in((args, kwargs)) + [p for p in module.parameters() if p.requires_grad]
        differentiable = [t for t in inputs if t.requires_grad]
        extra = max(peak - sum(s.storage_bytes for s in tensors) - saved, 0)
        outs = iter(_StandIn.apply(tensors, extra, saved, device, moved, *differentiable))
        return tree_unflatten([next(outs) if isinstance(leaf, TensorSpec) else leaf
                               for leaf in leaves], spec)

    return forward


def _resolved(target: str, owner: nn.Module, root: nn.Module) -> nn.Module | None:
    """The module a ``call_module`` target names: on the graph's owner, or (a region body in a
    kept block, whose targets stay qualified from the root) on the root."""
    for base in (owner, root):
        try:
            return base.get_submodule(target)
        except AttributeError:
            continue
    return None


def opaque_leaves(module: nn.Module) -> list[tuple[nn.Module, fx.Node]]:
    """(leaf module, one of its nodes) for every leaf of ``module``'s graphs (nested ones too)
    whose metadata came from a real run (``meta["fxopt_meta_source"] == "real"``), once per
    module object."""
    found: dict[int, tuple[nn.Module, fx.Node]] = {}
    for of in graphs_of(module):
        for node in of.graph.find_nodes(op="call_module"):
            if node.meta.get(meta_keys.META_SOURCE) != meta_keys.REAL:
                continue
            leaf = _resolved(node.target, of.host, module)
            if leaf is None:
                continue
            if id(leaf) not in found or META_KEY in node.meta:
                found[id(leaf)] = (leaf, node)
    return list(found.values())


def _replaying(module: nn.Module, record: LeafRecord, original: Any) -> Any:
    turns: dict[tuple, int] = {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        key = call_key(module, args, kwargs)
        calls = record.matching(key)
        if not calls:
            raise InputError(
                f"opaque leaf {record.path} ({record.module_type}) cannot run on fake tensors "
                f"and was run for real only on the example inputs' sizes, not on "
                f"{[list(shape) for shape, _ in key[1]]} in {'train' if key[0] else 'eval'} mode",
                where=f"leaf {record.path}",
                hint="predict with the example inputs the model was captured with, or capture "
                     "it again with inputs of the sizes to predict")
        call = calls[turns.get(key, 0) % len(calls)]
        turns[key] = turns.get(key, 0) + 1
        if not record.replays:
            memory = record.memory
            peak = getattr(memory, "peak_bytes", 0) or 0
            saved = getattr(memory, "saved_bytes", 0) or 0
            return _stand_in(module, call.outputs, peak, saved, call.home)(*args, **kwargs)
        with _Replay(call, call.moves(module, args, kwargs)):
            return original(*args, **kwargs)

    return forward


@contextlib.contextmanager
def forwards_patched(patches: list[tuple[nn.Module, Any]]) -> Iterator[None]:
    """Inside: each module's ``forward`` is the given function (restored afterwards, an
    instance-level forward of the user's included)."""
    held = [(m, m.__dict__.get("forward")) for m, _ in patches]
    try:
        for module, forward in patches:
            module.forward = forward
        yield
    finally:
        for module, previous in reversed(held):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous


@contextlib.contextmanager
def leaves_replayed(module: nn.Module) -> Iterator[list[str]]:
    """Inside: every leaf of ``module`` with a record runs on fakes by replaying it (or as its
    recorded stand-in). Yields their paths."""
    found = [(leaf, node.meta[META_KEY]) for leaf, node in opaque_leaves(module)
             if META_KEY in node.meta]
    with forwards_patched([(leaf, _replaying(leaf, record, leaf.forward))
                           for leaf, record in found]):
        yield [record.path for _, record in found]


@contextlib.contextmanager
def unrecorded_leaves_stood_in(module: nn.Module) -> Iterator[list[str]]:
    """Inside: every leaf of ``module`` that could only run for real and has no record (its
    real run was not possible) gets outputs like its ``meta["val"]`` and gradients for its
    inputs and parameters; nothing inside it is counted. Yields their paths."""
    found = [(leaf, node) for leaf, node in opaque_leaves(module) if META_KEY not in node.meta]
    with forwards_patched([(leaf, _stand_in(leaf, spec_of(node.meta["val"]), 0, 0,
                                            str(_captured_home(node))))
                           for leaf, node in found]):
        yield [node.target for _, node in found]


def leaf_records(module: nn.Module) -> list[LeafRecord]:
    """The records of ``module``'s opaque leaves (nested graphs included), once each."""
    seen: dict[int, LeafRecord] = {}
    for _, node in opaque_leaves(module):
        record = node.meta.get(META_KEY)
        if record is not None:
            seen.setdefault(id(record), record)
    return list(seen.values())


def recorded_outputs(node: fx.Node, leaf: nn.Module, args: Any, kwargs: Any) -> Any:
    """The recorded outputs of ``node``'s leaf for a call like this one, built in the current
    mode (fakes, in shape propagation), or None without a matching record. Marks the record
    as not replaying: its replay was what failed."""
    record = node.meta.get(META_KEY)
    calls = record.matching(call_key(leaf, args, kwargs)) if record is not None else []
    if not calls:
        return None
    record.replays = False
    return built(calls[0].outputs, calls[0].moves(leaf, args, kwargs))


def _captured_home(node: fx.Node) -> torch.device:
    """The device a leaf's node ran on at capture, from its inputs' and outputs' values."""
    return device_of(([a.meta.get("val") for a in node.all_input_nodes], node.meta.get("val")))


def nodes_calling(module: nn.Module, leaf: nn.Module) -> list[fx.Node]:
    """Every ``call_module`` node of ``module``'s graphs (nested ones too) that calls ``leaf``."""
    return [node for of in graphs_of(module) for node in of.graph.find_nodes(op="call_module")
            if _resolved(node.target, of.host, module) is leaf]
