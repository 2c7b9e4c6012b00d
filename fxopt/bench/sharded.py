"""FSDP2 training steps of a model and what they hold, per rank: for tests and benchmarks.

``shard_per_block(module, blocks)`` applies ``fully_shard`` to each block, then to the root, as
torchtitan does. ``ShardedStep`` runs training steps of a sharded module and measures, per rank:

- the step peak: bytes of every storage allocated during forward, ``backward()``, the optimizer
  step and ``zero_grad`` (``LiveStorageTracker(follow_resizes=True)``, which also sees FSDP2
  free and re-gather parameters by resizing storages in place), exact on CPU;
- the memory resident between steps: the tensor storages the module and the optimizer hold,
  at their current size (``resident_bytes``), before each measured step.

CPU only (the figures count storages, not an allocator), meant for gloo process groups.
"""

from __future__ import annotations

import gc
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxopt.analysis.memtrack import LiveStorageTracker


def shard_per_block(module: nn.Module, blocks: list[str]) -> nn.Module:
    """``fully_shard`` each of ``blocks`` (module paths), then ``module`` itself."""
    from torch.distributed.fsdp import fully_shard

    for path in blocks:
        fully_shard(module.get_submodule(path))
    fully_shard(module)
    return module


def resident_bytes(*roots: Any) -> int:
    """Bytes of the real tensor storages reachable from ``roots`` (a module, its optimizer),
    at their current size, or with no roots every one alive in the process. A DTensor counts
    its local shard; fake tensors have no data and do not count. References are followed
    through containers and objects' attributes, not through classes, modules or functions
    (which lead to everything), nor into a DeviceMesh (``_bookkeeping``)."""
    gc.collect()
    tensors = _reachable_tensors(roots) if roots else (
        o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    seen: set[int] = set()
    total = 0
    for obj in tensors:
        local = getattr(obj, "_local_tensor", obj)
        try:
            storage = local.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake, functional or meta: no data
            continue
        if address and address not in seen:
            seen.add(address)
            total += storage.nbytes()
    return total


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, types.CodeType, types.FrameType, str, bytes)


def _bookkeeping() -> tuple[type, ...]:
    """Distributed bookkeeping that is no model memory: a DeviceMesh's tensor of rank ids
    (4 bytes on 2 ranks), one per mesh FSDP2 made."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.device_mesh import DeviceMesh

    return (DeviceMesh,)


def _reachable_tensors(roots: tuple) -> list[torch.Tensor]:
    skip = _OPAQUE + _bookkeeping()
    found, seen, stack = [], set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        stack.extend(gc.get_referents(obj))
    return found


@dataclass
class ShardedStep:
    """Training steps of a sharded ``module``: ``loss_of(module, step) -> loss``."""

    module: nn.Module
    loss_of: Callable[[nn.Module, int], torch.Tensor]
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)

    def run(self, step: int, *, measure: bool = True) -> None:
        """One step; with ``measure`` its peak (and the bytes the module and the optimizer hold
        before it) are recorded, else only its time (a tracker costs time)."""
        if measure:
            self.resident.append(resident_bytes(self.module, self.optimizer))
            tracker = LiveStorageTracker(follow_resizes=True)
            with tracker:
                loss = self._step(step)
            self.peaks.append(tracker.peak_bytes)
        else:
            start = time.perf_counter()
            loss = self._step(step)
            self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss)

    def _step(self, step: int) -> float:
        loss = self.loss_of(self.module, step)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def full_state(self) -> dict[str, Any]:
        """The state dict with every DTensor gathered to a full tensor (a collective: every
        rank calls it)."""
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
                for k, v in self.module.state_dict().items()}
