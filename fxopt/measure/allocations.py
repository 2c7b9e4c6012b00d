"""Peak bytes the allocator hands out while a callable runs: what a compiled model really uses.

``fxopt.measure`` counts tensor storages with a TorchDispatchMode. That cannot measure a
``torch.compile``d model: with a dispatch mode active, dynamo runs the model eagerly instead of
the compiled graph (checked on torch 2.14: the tracked ops are the undecomposed eager ones). This
module reads the allocator itself, so any model can be compared with any other by one method:

- CPU: the allocation and free events ``torch.profiler`` records with ``profile_memory=True``
  (every CPU allocation with its size and time, from any thread); the peak is the largest running
  sum over the call. It sees a few kilobytes more than storage tracking (small allocator-level
  buffers kernels use internally), nothing less.
- CUDA: the caching allocator's ``max_memory_allocated`` over the call, from the allocated bytes
  before it.

The figure is bytes above what was allocated when the call started (the baseline is not in it).
Profiling slows the call down: never time a run measured here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Kineto writes start/stop lines straight to file descriptor 2: point it at /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cuda_peak_during(run: Callable[[], object], device: torch.device) -> int:
    """The CUDA caching allocator's peak on ``device`` while ``run()`` executes, above the bytes
    allocated when it started (the peak statistics of ``device`` are reset)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def peak_allocated_during(run: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated on ``device`` above the starting level while ``run()`` executes."""
    if device.type == "cuda":
        return cuda_peak_during(run, device)
    with _quiet_stderr_fd(), profile(activities=[ProfilerActivity.CPU],
                                     profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
