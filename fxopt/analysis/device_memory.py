"""What fake tensors cannot know about a device's memory, measured on the device once.

A kernel can hold memory it never returns as a tensor: cuDNN convolutions (forward and both
backward halves) take a workspace from the CUDA caching allocator for the length of the call,
and the allocator counts it in ``torch.cuda.max_memory_allocated``. A fake-tensor run sees the
op's outputs only, so a conv net's predicted peak was up to 50% low on an H200 (densenet121 at
batch 1). ``measure_device_memory`` finds the ops of one training step that may hold such memory
(``WORKSPACE_OPS``), as they are called (shapes, strides, dtypes, options), by a fake run; then
runs each distinct call once for real on the device, on random inputs of that layout, and keeps
what the allocator's peak shows beyond the call's outputs. ``LiveStorageTracker`` then holds
each op's workspace while it runs in every prediction (``fxopt.core.training_setup.DeviceMemory``).

A call is run twice and the second is measured: the first may initialise what a library keeps
for the rest of the process (cuBLAS's workspace, cuDNN's plans), which a training step in
steady state does not allocate again. Only one call's inputs are alive at a time: the probe
needs the memory of the largest single op, never of the model.

``probe=`` replaces the real run (how the CPU tests drive the same path: the CPU's kernels
hold nothing the allocator would count, so the real probe finds 0 there).

Not handled: memory a kernel allocates outside the caching allocator (cudaMalloc by a library:
not in ``max_memory_allocated`` either), and ops on fakes that take another kernel than on the
device (fake tensors choose the math attention where the GPU runs flash or memory-efficient
attention; the budget check of ``fxopt.measure.budget_check`` catches what remains).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxopt.graph.fake_run import on_fake_tensors, opaque_leaves_stood_in, training_flags
from fxopt.core.step import training_step
from fxopt.core.tensors import allocated_bytes, tensors_in
from fxopt.core.torch_private import TorchDispatchMode, tree_map_only
from fxopt.core.training_setup import DeviceMemory, TrainingSetup, op_signature

aten = torch.ops.aten
WORKSPACE_OPS = frozenset({
    aten.convolution.default, aten.convolution_backward.default,
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
})

Probe = Callable[[Any, tuple, dict], int]


class _Calls(TorchDispatchMode):
    """Records each distinct call of a ``WORKSPACE_OPS`` op: signature -> (op, args, kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[tuple, tuple[Any, tuple, dict]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in WORKSPACE_OPS:
            self.calls.setdefault(op_signature(func, args, kwargs), (func, args, kwargs))
        return func(*args, **kwargs)


def _real_like(value: Any) -> Any:
    def make(t: torch.Tensor) -> torch.Tensor:
        real = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return real.normal_() if real.is_floating_point() else real.zero_()
    return tree_map_only(torch.Tensor, make, value)


def cuda_workspace(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes the caching allocator's peak shows during one call of ``func`` beyond its outputs
    (the second of two calls; module docstring)."""
    real_args, real_kwargs = _real_like((args, kwargs))
    device = next(t.device for t in tensors_in((real_args, real_kwargs)))
    with torch.no_grad():
        func(*real_args, **real_kwargs)  # what a library keeps for the process
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = func(*real_args, **real_kwargs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    return max(peak - allocated_bytes(out), 0)


def measure_device_memory(module: nn.Module, example_inputs: Any, training: TrainingSetup, *,
                          probe: Probe | None = None) -> DeviceMemory | None:
    """The workspaces of ``module``'s training step on ``training.device`` (module docstring);
    None where nothing needs measuring (the CPU, unless a ``probe`` is given)."""
    if probe is None:
        if training.device.type != "cuda":
            return None
        probe = cuda_workspace
    recorder = _Calls()
    with opaque_leaves_stood_in(module), on_fake_tensors(module, example_inputs) as run, \
            training_flags(module, True), torch.enable_grad(), training.precision():
        with recorder:
            training_step(module, run.inputs)
    workspaces = {}
    for signature, (func, args, kwargs) in recorder.calls.items():
        bytes_ = probe(func, args, kwargs)
        if bytes_:
            workspaces[signature] = bytes_
    return DeviceMemory(measured_on=str(training.device), workspaces=workspaces)
