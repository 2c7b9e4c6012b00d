"""The eager machinery of a checkpointed region: saved-tensor hooks over two pre-built graphs.

A region (``fxopt.runtime.regions.CheckpointedRegion``) holds, besides its plain body, a
*recompute graph* built when the model was optimized. In a training forward, the region runs its
forward under ``torch.autograd.graph.saved_tensors_hooks`` with a ``RegionFrame``'s pack hook,
which keeps nothing: each tensor autograd saves becomes a ``_Slot``. The first time backward
unpacks one, the recompute graph runs (grad enabled, under a second pack hook that fills the
slots in the order the forward made them) and every slot gets its tensor; each is dropped once
backward has read it. This is what ``torch.utils.checkpoint(use_reentrant=False)`` does, with three
differences that make the recompute cost only its arithmetic:

- **Selective regions keep by graph, not by dispatch mode.** The planner names the nodes whose
  outputs the region keeps (convolutions, matmuls). Their outputs leave the forward as extra
  results (kept for backward) and the recompute graph reads them in place of running the nodes,
  so nothing intercepts ATen ops at run time (torch's selective checkpointing runs a Python
  ``TorchDispatchMode`` callback per op, in forward and again in recompute). A kept node runs
  between ``enter_kept(frame, base, *inner)`` and ``leave_kept(frame)``: what it saves that is one
  of ``inner`` (values of the region its recompute graph rebuilds), or a view of one, is matched to
  that value of the recompute graph's result (``base + i``); anything else it saves (a weight, an
  input of the region, another kept output, its own internal results) is kept as it is.
- **RNG state is stashed only when the region draws random numbers** (the graph says so when it is
  built; ``random``), and restored around the recomputation, on the CPU and on the devices of the
  region's tensors.
- **BatchNorm is recomputed without touching its buffers** where that is exact: the recompute
  graph calls ``recomputed_batch_norm`` (training mode: ``torch.batch_norm`` over scratch running
  statistics, which it updates and nobody reads; the output depends on the batch alone), and
  leaves out the counter's ``add_``. Only a region that writes other buffers (an unknown module
  holding buffers, a norm in a form the builder does not know, spectral norm's power iteration)
  recomputes over copies of them as the forward found them (``shield``:
  ``fxopt.runtime.regions.buffers_as_before``).

The region's inputs and kept outputs are saved by a small autograd function (``_Keep``), as
autograd saves any tensor: saved-tensor hooks around the model (``save_on_cpu``) see them, and a
tensor changed in place after the region raises autograd's own error when backward needs it. Kept
outputs are released once the recomputation has read them, as torch's selective checkpointing
does: backward through a selective region works once (a second one, ``retain_graph=True``,
raises), unless that backward builds a graph (``create_graph=True``: a gradient penalty), whose
own backward recomputes again; a full region recomputes again for every backward.

Autocast is recorded in forward and the recomputation runs under the same settings, and so are
the tensors the region's modules hold: a parameter or buffer swapped in for the forward alone
(``torch.func.functional_call``, whose backward runs after it) is put back for the
recomputation, where ``torch.utils.checkpoint`` would recompute with the module's own. Grads flow
through the region's own forward graph into the parameters' ``.grad`` by the normal autograd
engine (no reentrant backward), so DDP's and FSDP2's hooks see them as usual.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .errors import ConfigError


class _Slot:
    """What the forward's pack hook gives autograd for one saved tensor: empty until the
    recomputation fills it. ``arg``: for a tensor a kept node saved, the index of the value in
    the recompute graph's result that it is (``view``: the view of it, as (size, stride, storage
    offset from the value's), when it is one)."""

    __slots__ = ("value", "arg", "view")

    def __init__(self, arg: int | None = None, view: tuple | None = None):
        self.value: torch.Tensor | None = None
        self.arg = arg
        self.view = view


class _Keep(torch.autograd.Function):
    """Saves tensors for backward as autograd saves any (hooks see them, in-place changes after
    the save are caught on unpack); its output is never used, so it never runs backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - the output is never used
        return (None,) * (1 + len(ctx.saved_tensors))


def _flatten(values: Any, tensors: list[torch.Tensor]) -> Any:
    """``values`` with each tensor replaced by its index in ``tensors`` (appended there)."""
    if isinstance(values, torch.Tensor):
        tensors.append(values)
        return _TensorAt(len(tensors) - 1)
    if isinstance(values, (tuple, list)):
        return type(values)(_flatten(v, tensors) for v in values)
    return values


def _unflatten(structure: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
    if isinstance(structure, _TensorAt):
        return tensors[structure.index]
    if isinstance(structure, (tuple, list)):
        return type(structure)(_unflatten(v, tensors) for v in structure)
    return structure


class _TensorAt:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _tensors(values: tuple) -> tuple[tuple[torch.Tensor, ...], Any]:
    """(the tensors in ``values``, their structure: None when ``values`` holds tensors only)."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return tuple(values), None
    flat: list[torch.Tensor] = []
    structure = _flatten(values, flat)
    return tuple(flat), structure


def _devices(values: Any) -> list[torch.device]:
    """The non-CPU devices of the tensors in ``values`` (RootState slots included)."""
    found: dict[torch.device, None] = {}
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            found.setdefault(value.device)
    return list(found)


class _RngState:
    """The CPU generator's state and each device's, as the forward found them."""

    __slots__ = ("cpu", "device_type", "devices", "states")

    def __init__(self, devices: list[torch.device]):
        self.cpu = torch.get_rng_state()
        device_type = devices[0].type if devices else None
        module = _generators_of(device_type) if device_type else None
        self.device_type = device_type if module is not None else None
        self.devices = [d.index for d in devices if d.type == device_type] if module else []
        self.states = [module.get_rng_state(d) for d in self.devices] if module else []

    @contextlib.contextmanager
    def replayed(self):
        """Inside, the generators are as the forward found them; after, as they were."""
        kwargs = {"device_type": self.device_type} if self.device_type else {}
        with torch.random.fork_rng(devices=self.devices, **kwargs):
            torch.set_rng_state(self.cpu)
            if self.device_type:
                module = torch.get_device_module(self.device_type)
                for device, state in zip(self.devices, self.states):
                    module.set_rng_state(state, device)
            yield


def _generators_of(device_type: str) -> Any:
    """The module holding ``device_type``'s random generators (``torch.cuda``), or None where
    there is no state to keep: not initialized yet (as torch's checkpoint: no device state
    before the device is used) or no such module (``meta`` tensors draw no numbers)."""
    try:
        module = torch.get_device_module(device_type)
    except RuntimeError:
        return None
    return module if getattr(module, "is_initialized", lambda: True)() else None


def _autocast_state(device_type: str) -> tuple:
    """(device type, enabled, dtype) for the CPU and ``device_type``, and the cache flag."""
    types = ("cpu",) if device_type == "cpu" or not torch.amp.is_autocast_available(
        device_type) else ("cpu", device_type)
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                 for t in types) + (torch.is_autocast_cache_enabled(),)


class RegionFrame:
    """One training-mode call of a region: its slots, what it keeps, and how to recompute."""

    __slots__ = ("recompute_graph", "reads", "shield", "slots", "arg_slots", "marked", "rng",
                 "autocast", "keep", "structure", "filled", "selective", "held", "__weakref__")

    def __init__(self, recompute_graph: Any, reads: Any, shield: Any, selective: bool):
        self.recompute_graph = recompute_graph  # callable(reads, *inputs, *kept) -> inner values
        self.reads = reads
        self.shield = shield        # a context manager factory over ``reads``, or None
        self.selective = selective
        self.slots: list[_Slot] = []      # tensors saved by the nodes the recompute graph runs
        self.arg_slots: list[_Slot] = []  # tensors kept nodes saved that the recompute rebuilds
        self.marked: tuple | None = None  # (base, inner values) while a kept node runs
        self.rng: _RngState | None = None
        self.autocast: tuple | None = None
        self.keep: Any = None             # the _Keep node holding inputs and kept outputs
        self.structure: Any = None
        self.filled = 0
        self.held: list[tuple[dict, str, torch.Tensor]] = []  # what the modules read held

    # -- forward ---------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        marked = self.marked
        if marked is None:
            slot = _Slot()
            self.slots.append(slot)
            return slot
        base, inner = marked
        for index, value in enumerate(inner):
            if tensor is value:
                slot = _Slot(base + index)
                break
            if isinstance(value, torch.Tensor) and _same_storage(tensor, value):
                offset = tensor.storage_offset() - value.storage_offset()  # from the value's
                slot = _Slot(base + index, (tensor.size(), tensor.stride(), offset))
                break
        else:
            # a weight, an input, a kept output, an internal result: kept as it is (detached:
            # the tensor itself would tie an output to its own grad_fn in a cycle gc cannot see)
            return tensor.detach()
        self.arg_slots.append(slot)
        return slot

    def unpack(self, packed: Any) -> Any:
        if type(packed) is not _Slot:
            return packed
        if packed.value is None:
            self.recompute()
        value, packed.value = packed.value, None
        return value

    def save(self, inputs: tuple, kept: tuple) -> None:
        """Keep the region's inputs and kept outputs for the recomputation (``_Keep``). Kept
        outputs are saved detached (their grad_fns lie in the region, whose saved tensors refer
        to this frame: a cycle gc cannot see) and require grad again when read."""
        flat_inputs, flat_kept = _tensors(inputs), _tensors(kept)
        self.structure = (len(flat_inputs[0]), flat_inputs[1], flat_kept[1],
                          tuple(t.requires_grad for t in flat_kept[0]))
        anchor = torch.empty(0, requires_grad=True)
        self.keep = _Keep.apply(anchor, *flat_inputs[0],
                                *(t.detach() for t in flat_kept[0])).grad_fn

    def _saved(self) -> tuple[Any, Any]:
        """(inputs, kept outputs), as ``save`` got them."""
        count, inputs, kept, grads = self.structure
        tensors = self.keep.saved_tensors
        flat_kept = [t.requires_grad_() if grad and not t.requires_grad else t
                     for t, grad in zip(tensors[count:], grads)]
        return (tensors[:count] if inputs is None else _unflatten(inputs, tensors[:count]),
                tuple(flat_kept) if kept is None else _unflatten(kept, flat_kept))

    # -- backward --------------------------------------------------------------------------

    def recompute(self) -> None:
        if self.keep is None:
            raise ConfigError(
                "backward ran through a selective checkpointed region of an fxopt-optimized "
                "module a second time (retain_graph=True); the outputs it kept were released "
                "after the first backward, as torch's selective checkpointing releases them",
                where="a backward through a graph a first backward had gone through",
                hint="call the module again for each backward; a backward that builds a graph "
                     "(torch.autograd.grad(..., create_graph=True), as a gradient penalty does) "
                     "keeps them for the next one")
        inputs, kept = self._saved()
        self.filled = 0
        hooks = torch.autograd.graph.saved_tensors_hooks(self._fill, _unused)
        swapped = [(owner, name, tensor) for owner, name, tensor in self.held
                   if owner.get(name) is not tensor and _allocated(tensor)]
        if (self.rng is None and self.shield is None and not swapped
                and not self._autocast_differs()):
            with torch.enable_grad(), hooks:
                values = self.recompute_graph(self.reads, *inputs, *kept)
        else:
            with contextlib.ExitStack() as scope:
                if self.rng is not None:
                    scope.enter_context(self.rng.replayed())
                for device_type, enabled, dtype in self.autocast[:-1]:
                    if (torch.is_autocast_enabled(device_type) != enabled
                            or (enabled and torch.get_autocast_dtype(device_type) != dtype)):
                        scope.enter_context(torch.autocast(
                            device_type, dtype=dtype, enabled=enabled,
                            cache_enabled=self.autocast[-1]))
                if swapped:
                    scope.enter_context(_held_as_in_forward(swapped))
                if self.shield is not None:
                    scope.enter_context(self.shield(self.reads))
                scope.enter_context(torch.enable_grad())
                scope.enter_context(hooks)
                values = self.recompute_graph(self.reads, *inputs, *kept)
        if self.filled != len(self.slots):
            raise RuntimeError(
                f"a checkpointed region of an fxopt-optimized module saved {len(self.slots)} "
                f"tensors for backward in its forward but {self.filled} when recomputed: its "
                "computation depends on something other than its inputs (global state changed "
                "between forward and backward, or nondeterministic control flow)")
        for slot in self.arg_slots:
            value = values[slot.arg].detach()
            if slot.view is not None:
                size, stride, offset = slot.view
                value = value.as_strided(size, stride, value.storage_offset() + offset)
            slot.value = value
        if self.selective and not torch.is_grad_enabled():
            # kept outputs: released once recomputation has read them, unless this backward
            # builds a graph (create_graph=True), whose own backward reads them again
            self.keep = None

    def _autocast_differs(self) -> bool:
        """Whether autocast is set otherwise now than in the forward (backward usually runs
        outside the forward's autocast)."""
        return any(torch.is_autocast_enabled(device_type) != enabled
                   or (enabled and torch.get_autocast_dtype(device_type) != dtype)
                   for device_type, enabled, dtype in self.autocast[:-1])

    def _fill(self, tensor: torch.Tensor) -> None:
        index = self.filled
        self.filled += 1
        if index < len(self.slots):
            self.slots[index].value = tensor.detach() if tensor.requires_grad else tensor
        return None


@contextlib.contextmanager
def _held_as_in_forward(swapped: list[tuple[dict, str, torch.Tensor]]) -> Any:
    """Inside, each module holds the parameter or buffer it held in the forward again (put back
    into its ``_parameters`` or ``_buffers``), where something replaced it since:
    ``torch.func.functional_call`` swaps its tensors in for the forward only, and backward then
    ran outside it. torch.utils.checkpoint recomputes with what the modules hold at backward, so
    gradients there miss the tensors the forward computed with."""
    now = [(owner, name, owner.get(name)) for owner, name, _ in swapped]
    for owner, name, tensor in swapped:
        owner[name] = tensor
    try:
        yield
    finally:
        for owner, name, tensor in now:
            owner[name] = tensor


def _allocated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still has its memory: FSDP2 frees the storage of the unsharded
    parameter between forward and backward, and has it back (the same object) by the time a
    region recomputes."""
    try:
        return tensor.untyped_storage().nbytes() > 0 or tensor.numel() == 0
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
        return False


def _unused(packed: Any) -> Any:  # pragma: no cover - the recomputed graph never runs backward
    return packed


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage() is b.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
        return False


def enter_kept(frame: RegionFrame | None, base: int, *inner: Any) -> None:
    """Before a kept node of a region's forward: what it saves that is one of ``inner`` (or a
    view of one) is rebuilt from the recompute graph's results ``base``, ``base + 1``, ..."""
    if frame is not None:
        frame.marked = (base, inner)


def leave_kept(frame: RegionFrame | None) -> None:
    """After a kept node: what later nodes save is recomputed again."""
    if frame is not None:
        frame.marked = None
