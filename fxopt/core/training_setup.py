"""``TrainingSetup``: the one description of the training step fxopt plans, predicts and checks.

Every prediction (``fxopt.analysis.estimate``), every plan (the checkpoint problem, the chunked
loss, the schedule) and the closing check of a budget read this one object, so no two parts of
fxopt plan for different trainings:

- ``device``: where the step runs (the model's device when ``fxopt.optimize`` was called);
- ``autocast``: ``(device_type, dtype)`` of the ``torch.autocast`` the step runs under, or None
  (full precision). ``fxopt.optimize`` takes the autocast active where it is called;
- ``fused_optimizer``: the user's optimizer step fused into backward (``fxopt.fuse_optimizer``):
  each gradient is freed at its step;
- ``sharded_blocks``: the module will be sharded with FSDP2 per block (``fully_shard`` on each of
  ``fxopt.blocks(module)``, then the root): a block's gradients leave when its backward ends;
- ``outputs``: ``"all"`` (the loop may read every output) or ``"loss"`` (the loop reads only the
  loss: logits the model only returns need not be built);
- ``device_memory``: what fake tensors cannot know about the device's memory, measured on it
  (``fxopt.analysis.device_memory``): kernel workspaces that the CUDA caching allocator hands
  out during a call. None where predictions need nothing more (the CPU, where fake-tensor
  predictions are exact).

A setup is data: it holds no tensors and no module (the fused optimizer is the user's object).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fxopt.core.errors import ConfigError
from fxopt.runtime.fused_step import FusedOptimizers, fused_optimizers
from fxopt.runtime.input_guard import autocast_state

OUTPUTS = ("all", "loss")


@dataclass(frozen=True)
class DeviceMemory:
    """What the device's allocator hands out beyond the tensors an op returns, measured on it.

    ``workspaces`` maps an op signature (``op_signature``) to the bytes a call of it holds while
    it runs beyond its inputs and outputs (cuDNN convolution workspaces, cuBLAS/cuBLASLt
    scratch), as the caching allocator counts them. ``measured_on`` names the device.
    """

    measured_on: str = ""
    workspaces: Mapping[tuple, int] = field(default_factory=dict)

    def workspace(self, signature: tuple) -> int:
        return self.workspaces.get(signature, 0)

    def __hash__(self) -> int:
        return hash((self.measured_on, len(self.workspaces)))


def op_signature(func: Any, args: Any, kwargs: Any) -> tuple:
    """What decides an op's workspace: the op, and each tensor argument's shape, stride, dtype
    and device type (plain arguments as they are)."""
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("T", tuple(value.shape), tuple(value.stride()), value.dtype,
                    value.device.type)
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return value
        return type(value).__name__
    return (str(func), describe(tuple(args)), describe(tuple(sorted((kwargs or {}).items()))))


@dataclass(frozen=True)
class TrainingSetup:
    """The training step fxopt plans for (module docstring)."""

    device: torch.device = torch.device("cpu")
    autocast: tuple[str, torch.dtype] | None = None
    fused_optimizer: FusedOptimizers = None
    sharded_blocks: bool = False
    outputs: str = "all"
    device_memory: DeviceMemory | None = None

    def __post_init__(self) -> None:
        if self.outputs not in OUTPUTS:
            raise ConfigError(f"outputs={self.outputs!r} is not one of {OUTPUTS}",
                              hint="outputs='all' (default): the training loop may read every "
                                   "output; outputs='loss': it reads only the loss")
        object.__setattr__(self, "device", torch.device(self.device))
        if self.fused_optimizer is not None:
            object.__setattr__(self, "fused_optimizer", fused_optimizers(self.fused_optimizer))

    def with_(self, **changes: Any) -> TrainingSetup:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return replace(self, **changes)

    @contextlib.contextmanager
    def precision(self) -> Iterator[None]:
        """Inside: the autocast the step runs under (nothing when it runs in full precision)."""
        if self.autocast is None:
            yield
            return
        device_type, dtype = self.autocast
        with torch.autocast(device_type, dtype=dtype):
            yield

    def describe(self) -> str:
        """One line for reports: ``cuda:0, bfloat16 autocast, fused optimizer step, loss only``."""
        parts = [str(self.device)]
        if self.autocast is not None:
            parts.append(f"{str(self.autocast[1]).removeprefix('torch.')} autocast")
        if self.fused_optimizer:
            parts.append("optimizer step fused into backward")
        if self.sharded_blocks:
            parts.append("FSDP2 per block")
        if self.outputs == "loss":
            parts.append("loss only")
        if self.device_memory is not None and self.device_memory.measured_on:
            parts.append(f"workspaces measured on {self.device_memory.measured_on}")
        return ", ".join(parts)


def ambient_autocast(device: torch.device) -> tuple[str, torch.dtype] | None:
    """The autocast active for ``device``'s type where this is called, or None
    (``fxopt.runtime.input_guard.autocast_state``, which export-captured graphs check calls
    with)."""
    ((device_type, dtype),) = autocast_state([torch.device(device).type])
    return (device_type, dtype) if dtype is not None else None
