"""FSDP2 training steps of a model and what they hold, per rank: for tests and benchmarks.

``shard_per_block(module, blocks)`` applies ``fully_shard`` to each block, then to the root, as
torchtitan does. ``ShardedStep`` runs training steps of a sharded module and measures, per rank:

- the step peak: bytes of every storage allocated during forward, ``backward()``, the optimizer
  step and ``zero_grad`` (``LiveStorageTracker(follow_resizes=True)``, which also sees FSDP2
  free and re-gather parameters by resizing storages in place), exact on CPU;
- the memory resident between steps: every real tensor storage the process can reach after
  each measured step, at its current size, beyond those it held before the model was built
  (``resident_bytes(excluding=baseline)``, ``baseline = live_storages()`` taken before building
  it): whatever keeps a storage alive counts, the module and the optimizer or anything else.

CPU only (the figures count storages, not an allocator), meant for gloo process groups.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxopt.analysis.memtrack import LiveStorageTracker


def shard_per_block(module: nn.Module, blocks: list[str], mp_policy: Any = None) -> nn.Module:
    """``fully_shard`` each of ``blocks`` (module paths), then ``module`` itself, with FSDP2's
    ``mp_policy`` (a ``MixedPrecisionPolicy``) where one is given."""
    from torch.distributed.fsdp import fully_shard

    options = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for path in blocks:
        fully_shard(module.get_submodule(path), **options)
    fully_shard(module, **options)
    return module


def live_storages() -> dict[int, Any]:
    """Every real tensor storage the process can reach, by address: the storage of each tensor
    the garbage collector tracks (a DTensor counts its local shard; fake, functional and meta
    tensors have no data). The storage objects are the values, so no address in the result is
    reused while it is held: ``resident_bytes(excluding=...)`` leaves exactly these out.

    Objects frozen with ``gc.freeze()`` are not looked at: a worker that freezes what its
    imports made, before building any model, makes each call take milliseconds instead of a
    second (a full collection and a scan of every object torch and transformers made)."""
    gc.collect()
    found: dict[int, Any] = {}
    for obj in gc.get_objects():
        # not isinstance: it reads __class__, which warns for torch.distributed.reduce_op
        if not issubclass(type(obj), torch.Tensor):
            continue
        local = getattr(obj, "_local_tensor", obj)
        try:
            storage = local.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake, functional or meta: no data
            continue
        if address:
            found.setdefault(address, storage)
    return found


def resident_bytes(excluding: Mapping[int, Any] | None = None) -> int:
    """Bytes, at their current size, of the ``live_storages()`` not in ``excluding`` (an earlier
    ``live_storages()``, held since: what the process held before a model was built). Whatever
    keeps a storage reachable counts, not only the module and its optimizer: a closure, a cache,
    a report, an autograd graph left behind."""
    excluding = excluding or {}
    return sum(storage.nbytes() for address, storage in live_storages().items()
               if address not in excluding)


@dataclass
class ShardedStep:
    """Training steps of a sharded ``module``: ``loss_of(module, step) -> loss``.
    ``baseline``: ``live_storages()`` taken before the model was built (empty: every storage of
    the process counts as resident)."""

    module: nn.Module
    loss_of: Callable[[nn.Module, int], torch.Tensor]
    optimizer: torch.optim.Optimizer
    baseline: Mapping[int, Any] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)

    def run(self, step: int, *, measure: bool = True) -> None:
        """One step; with ``measure`` its peak and the bytes resident after it are recorded,
        else only its time (a tracker costs time)."""
        if measure:
            tracker = LiveStorageTracker(follow_resizes=True)
            with tracker:
                loss = self._step(step)
            self.peaks.append(tracker.peak_bytes)
            self.resident.append(resident_bytes(excluding=self.baseline))
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
