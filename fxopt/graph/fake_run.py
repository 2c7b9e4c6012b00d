"""Run a module on fake tensors without touching the user's tensors or the global RNG.

``on_fake_tensors(module, example_inputs)`` is a context manager that swaps every parameter and
buffer of ``module`` for a fake copy (same shape, stride, dtype, ``requires_grad``; tied weights
stay tied), turns the example inputs into fake tensors of the same mode, and enters that
``FakeTensorMode``. Whatever runs inside -- forward, backward, BatchNorm's running-stat update,
dropout -- happens on fakes: no real compute, no real memory, the real buffers, ``.grad`` and the
RNG are left exactly as they were.

Meta kernels that under-report memory are corrected: ``aten.mkldnn_rnn_layer`` (the CPU LSTM/GRU
path) returns an empty oneDNN workspace on fakes, while the real kernel returns one that autograd
saves for backward. Its size depends on oneDNN's internal layout, which no API exposes, so it is
probed once per argument signature by running that one layer for real on zeros (cached; the
only real compute in a fake run, and the probe's memory is the layer's own).

A chunked LM loss (``fxopt.runtime.chunked_loss``) runs three of its chunks on fakes
(``chunks_sampled``): the others allocate and free exactly as the second does, so the memory
observed is the whole loop's.

Opaque leaves that cannot run on fakes replay what they did on a real run on the example inputs
(``fxopt.graph.leaf_tape.leaves_replayed``), so a fake run sees what they allocate and save.

Example inputs may be real tensors or fake tensors of another mode (e.g. ``placeholder_values``
of a traced graph); the latter are rebuilt as fresh fakes with the same layout. Tensors that are
plain attributes (tracer constants) are converted on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxopt.graph.leaf_tape import leaves_replayed, unrecorded_leaves_stood_in
from fxopt.core.state import preserved_rng
from fxopt.runtime.chunked_loss import chunks_sampled
from fxopt.core.step import as_args
from fxopt.core.tensors import storage_bytes, storage_key
from fxopt.core.torch_private import (
    MKLDNN_RNN_WORKSPACE_INDEX,
    FakeTensor,
    FakeTensorMode,
    disable_current_modes,
    rebuild_rnn_weights,
    reparametrize_module,
    tree_map_only,
    view_base,
)


@dataclass
class FakeRun:
    """What ``on_fake_tensors`` yields: the mode, the fake inputs and the fake module state."""

    mode: FakeTensorMode
    inputs: tuple
    state: dict[str, torch.Tensor]     # qualified name -> fake parameter or buffer


def fake_copy(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake tensor of ``mode`` laid out like ``t``, with its ``requires_grad``.

    A real tensor goes through ``mode.from_tensor``, which memoizes: the same tensor gives the
    same fake, and views of one tensor give fakes sharing one storage. A fake (of this mode or
    another) is rebuilt as a fresh tensor of the same shape, stride, dtype and device, so storage
    shared between fakes is not carried over.
    """
    if isinstance(t, FakeTensor):
        with mode:
            fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return fresh.requires_grad_(t.requires_grad)
    return mode.from_tensor(t)


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under its qualified name(s), shared ones under each name."""
    state: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    return state


@contextlib.contextmanager
def training_flags(module: nn.Module, training: bool) -> Iterator[None]:
    """Inside: ``module.train(training)``; afterwards every submodule's own flag is back."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _below_first(roots: list[nn.Module]) -> list[nn.Module]:
    """Every module under ``roots`` once, each after every module below it (post-order).

    A module registered under two paths (``self.a = self.b = block``, a list and an attribute
    holding one module) is listed once, so each of its parameter slots is swapped once.
    """
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if id(m) not in seen:
            seen.add(id(m))
            for child in m.children():
                visit(child)
            order.append(m)

    for root in roots:
        visit(root)
    return order


def _own_tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers ``m`` itself holds (not its submodules'), by attribute name."""
    own: dict[str, torch.Tensor] = dict(m.named_parameters(recurse=False, remove_duplicate=False))
    own.update(m.named_buffers(recurse=False, remove_duplicate=False))
    return own


@contextlib.contextmanager
def reparametrized(module: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside: ``module``'s parameters and buffers are ``state`` (tied weights stay tied).

    Each slot (one module's own parameter or buffer) is swapped by the module that holds it,
    once. A qualified name is a path, not a slot: a submodule registered under two paths gives
    its slots two names each, and ``reparametrize_module(module, state)`` would swap such a slot
    once per name -- the second time saving the stand-in as the "original" -- and restore in
    the same order, leaving the stand-in in the user's module. Stand-ins are matched to slots by
    the identity of the tensor a slot holds: tied weights (two slots, one tensor) get one
    stand-in.

    Modules are swapped below-first: ``reparametrize_module`` (``tie_weights=True``) also swaps
    the slots of a module's submodules that hold one of the module's own tensors, so each slot's
    own module must be the first to swap it and, the contexts unwinding in reverse, the last to
    restore it.

    On exit, RNN modules rebuild their ``_flat_weights`` list, which the swap back does not
    update: it would go on holding the stand-ins (fake tensors) until the next forward.
    """
    real = module_state(module)  # matched by identity before the swap; keeps the ids alive
    stand_in = {id(real[name]): t for name, t in state.items() if name in real}
    try:
        with contextlib.ExitStack() as stack:
            for m in _below_first([module]):
                swap = {name: stand_in[id(t)] for name, t in _own_tensors(m).items()
                        if id(t) in stand_in}
                if swap:
                    stack.enter_context(reparametrize_module(m, swap))
            yield
    finally:
        for m in module.modules():
            rebuild_rnn_weights(m)


@contextlib.contextmanager
def on_fake_tensors(module: nn.Module, example_inputs: Any) -> Iterator[FakeRun]:
    """Inside: ``module`` computes on fake copies of its state; yields the fake inputs too."""
    mode = RealSizedFakeMode(allow_non_fake_inputs=True)
    converted: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in converted:  # one fake per real tensor, so tied weights stay tied
            converted[id(t)] = fake_copy(t, mode)
        return converted[id(t)]

    real_state = module_state(module)
    shared = _shared_storages(real_state.values())
    for t in real_state.values():
        if id(t) not in converted and _owns_storage(t, shared):
            converted[id(t)] = _fresh_fake(t, mode)
    state = {name: convert(t) for name, t in real_state.items()}
    inputs = tree_map_only(torch.Tensor, convert, as_args(example_inputs))
    with preserved_rng(), reparametrized(module, state), mode, leaves_replayed(module), \
            chunks_sampled():
        yield FakeRun(mode, inputs, state)


def _shared_storages(tensors: Any) -> set[int]:
    """Storage keys held by more than one distinct tensor."""
    owner: dict[int, int] = {}
    shared = set()
    for t in tensors:
        key = storage_key(t)
        if owner.setdefault(key, id(t)) != id(t):
            shared.add(key)
    return shared


def _owns_storage(t: torch.Tensor, shared: set[int]) -> bool:
    """Whether ``t`` is a plain dense tensor alone on exactly its own storage: then a fresh fake
    of its layout is all a fake run needs (``mode.from_tensor`` describes far more, slowly)."""
    return (type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
            and not isinstance(t, FakeTensor) and view_base(t) is None and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and t.is_contiguous() and storage_key(t) not in shared)


def _fresh_fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return fresh.requires_grad_(t.requires_grad)


_WORKSPACE_BYTES: dict[tuple, int] = {}


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value


def _real_zeros(value: Any) -> Any:
    return torch.zeros(value.shape, dtype=value.dtype, device=value.device)


def _mkldnn_rnn_workspace_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    key = _signature((args, tuple(sorted(kwargs.items())), torch.is_grad_enabled()))
    if key not in _WORKSPACE_BYTES:
        with disable_current_modes():  # the kernel's workspace depends on the grad mode
            real_args, real_kwargs = tree_map_only(torch.Tensor, _real_zeros, (args, kwargs))
            workspace = func(*real_args, **real_kwargs)[MKLDNN_RNN_WORKSPACE_INDEX]
            _WORKSPACE_BYTES[key] = storage_bytes(workspace)
    return _WORKSPACE_BYTES[key]


class RealSizedFakeMode(FakeTensorMode):
    """A FakeTensorMode whose ops report the memory the real kernels allocate where a meta
    kernel under-reports it (``aten.mkldnn_rnn_layer``'s oneDNN workspace on the CPU).

    The correction lives in the mode's own dispatch, not in a dispatch mode stacked above it:
    a mode of its own costs every op of a fake run another trip through Python (7-9% of a
    prediction, measured on the densenet121 and the Llama of ``benchmarks/optimize_speed.py``),
    for the one op that needs it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._observer: Any = None
        self._depth = 0

    @contextlib.contextmanager
    def observed_by(self, observer: Any) -> Iterator[None]:
        """Inside: ``observer.before_op()`` and ``observer.after_op(func, args, kwargs, out)``
        run around every op handed to this mode (not the ops its own kernels and
        decompositions run inside one), as a dispatch mode stacked right above it would see
        them (``fxopt.analysis.memtrack.LiveStorageTracker.observing``)."""
        previous, self._observer = self._observer, observer
        try:
            yield
        finally:
            self._observer = previous

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        observer = self._observer if self._depth == 0 else None
        if observer is not None:
            observer.before_op()
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is _MKLDNN_RNN_LAYER:
                out = self._with_real_workspace(out, func, args, kwargs or {})
        finally:
            self._depth -= 1
        if observer is not None:
            observer.after_op(func, args, kwargs, out)
        return out

    def _with_real_workspace(self, out: tuple, func: Any, args: Any, kwargs: dict) -> tuple:
        index = MKLDNN_RNN_WORKSPACE_INDEX
        if out[index].numel() != 0 or out[index].device.type != "cpu":
            return out
        with self:  # inside its own dispatch the mode is off: the workspace must be fake too
            workspace = torch.empty(_mkldnn_rnn_workspace_bytes(func, args, kwargs),
                                    dtype=torch.uint8, device=out[index].device)
        return (*out[:index], workspace, *out[index + 1:])


_MKLDNN_RNN_LAYER = torch.ops.aten.mkldnn_rnn_layer.default


@contextlib.contextmanager
def opaque_leaves_stood_in(gm: nn.Module) -> Iterator[list[str]]:
    """Leaves that could only run for real (``meta["fxopt_meta_source"] == "real"``) and have no
    record of a real run on the example inputs (``fxopt.capture.leaf_recording``) get a stand-in
    forward that allocates outputs like their ``meta["val"]`` and grads for their inputs and
    parameters, so a fake run of ``gm`` goes through. Yields their paths.

    What such a leaf saves or allocates inside is unknown and not counted. (Recorded leaves
    replay their real run inside ``on_fake_tensors`` itself.)
    """
    with unrecorded_leaves_stood_in(gm) as paths:
        yield paths
