"""Bytes of tensors, identity of storages, and the device a module or graph runs on.

Every function takes a *value*: a tensor or any pytree holding tensors (tuples, lists, dicts,
``node.meta["val"]``); non-tensor leaves are ignored. Real and fake tensors are treated alike:
a fake storage has the size the real one would have.

Which byte count to use:

- ``storage_bytes(value)``: the memory the value holds. Each distinct storage counts once, with
  its full size: two views of one tensor count once, and a slice counts its whole base. Use it for
  what tensors keep alive (parameters, inputs, saved tensors) in figures that are not compared
  with the CUDA allocator's.
- ``allocated_bytes(value)``: ``storage_bytes`` as the allocator hands it out: a storage on a
  CUDA device counts as a whole number of 512-byte blocks (``CUDA_BLOCK_BYTES``), as
  ``torch.cuda.max_memory_allocated`` counts it with the caching allocator's default settings;
  other devices are not rounded. The tensor's device decides (a fake CUDA tensor is rounded
  although its storage is on ``meta``). Use it where figures must match the CUDA allocator: the
  live-storage tracker, the sizes the checkpoint planner fits into a budget.
- ``tensor_bytes(value)``: ``numel() * element_size()`` of each tensor, views and shared storages
  counted every time. The data an op reads or writes, or the size of a freshly allocated
  contiguous tensor of that shape (a parameter's gradient).

``storage_key(t)`` is the identity of ``t``'s storage: equal for views and in-place results of
one storage, different for clones. It is the address of the storage, so it identifies a storage
only while that storage is alive: keep the tensors (or a ``StorageWeakRef`` to detect frees) as
long as the keys are compared.

``format_bytes(n)`` writes a byte count as people read it (``1.5 MiB``).

``device_of(value)`` is the device that tensors compute on: the first CUDA device among them,
else the first tensor's device, else CPU. ``module_device`` and ``graph_device`` apply it to a
module with its inputs and to a graph with its ``meta["val"]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from fxopt.core.torch_private import storage_id
from fxopt.core.trees import leaves

CUDA_BLOCK_BYTES = 512


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors inside a value (a tensor, tuple, list, dict, dataclass, ...)."""
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    # Plain tuples, lists and dicts (every op's arguments and results) are walked here, the
    # rest by fxopt.core.trees: this runs for every op a tracker sees.
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif type(value) in (tuple, list):
        for item in value:
            _collect(item, found)
    elif type(value) is dict:
        for item in value.values():
            _collect(item, found)
    elif value is not None and not isinstance(value, (int, float, bool, str, torch.dtype,
                                                      torch.device)):
        found.extend(leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor))


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (its address): views and in-place results share it."""
    return storage_id(t.untyped_storage())


def _one_per_storage(value: Any) -> list[torch.Tensor]:
    """The first tensor of ``value`` on each distinct storage."""
    first: dict[int, torch.Tensor] = {}
    for t in tensors_in(value):
        first.setdefault(storage_key(t), t)
    return list(first.values())


def storage_bytes(value: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``value``, each counted once."""
    return sum(t.untyped_storage().nbytes() for t in _one_per_storage(value))


def allocated_bytes(value: Any) -> int:
    """``storage_bytes(value)`` with each CUDA tensor's storage rounded up to 512-byte blocks."""
    total = 0
    for t in _one_per_storage(value):
        nbytes = t.untyped_storage().nbytes()
        if t.device.type == "cuda":
            nbytes = -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
        total += nbytes
    return total


def tensor_bytes(value: Any) -> int:
    """``numel() * element_size()`` summed over the tensors in ``value``, shared storages too."""
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def device_of(value: Any) -> torch.device:
    """The first CUDA device among the tensors in ``value``, else the first tensor's, else CPU."""
    tensors = tensors_in(value)
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if cuda is not None:
        return cuda
    return tensors[0].device if tensors else torch.device("cpu")


def module_device(module: nn.Module, inputs: Any = ()) -> torch.device:
    """``device_of`` the module's parameters, buffers and ``inputs``."""
    return device_of((list(module.parameters()), list(module.buffers()), inputs))


def graph_device(gm: fx.GraphModule) -> torch.device:
    """``device_of`` the graph's parameters, buffers and the values in its nodes' ``meta["val"]``.

    A graph without ``meta["val"]`` (not yet propagated) is judged by its state alone.
    """
    return module_device(gm, [node.meta.get("val") for node in gm.graph.nodes])


def random_like(t: torch.Tensor) -> torch.Tensor:
    """A real tensor shaped like ``t`` (a fake or meta tensor, say) to run a kernel on: standard
    normal for floating and complex dtypes, zeros otherwise (valid indices, masks all False).
    Draws from the global RNG: callers that must not disturb it run under ``preserved_rng``."""
    if t.is_floating_point() or t.is_complex():
        return torch.randn(t.shape, dtype=t.dtype, device=t.device)
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def format_bytes(n: int) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (``512 B``, ``1.5 MiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
