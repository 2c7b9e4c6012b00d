"""Snapshot and restore everything a training step changes, so fxopt never leaves a trace.

``preserved_state(*modules)`` restores, on exit: every parameter's ``.grad`` (the same tensor
object or None, as before), every buffer's *values* (BatchNorm running stats, counters), the
parameter and buffer *objects* each module holds (a forward that does ``self.count = self.count +
1`` replaces its buffer: the original object is put back), each module's ``training`` flag, and
the CPU and CUDA RNG states. It is what lets ``verify`` and
``measure`` run real training steps on the user's own Parameter objects.

Parameter *values* are not snapshotted (a copy of the model's weights would double its memory):
nothing inside may update them. Optimizers the user fused into backward
(``fxopt.fuse_optimizer``) would, so they are ``paused()`` inside: fxopt's own training steps
accumulate gradients as an unfused model does, and nothing is stepped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fxopt.core.modules import own_tensors, restore_own_tensors
from fxopt.runtime.fused_step import paused


def _unique_tensors(modules: tuple[nn.Module, ...], kind: str) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        named = module.named_parameters if kind == "params" else module.named_buffers
        for _, t in named(remove_duplicate=False):
            seen.setdefault(id(t), t)
    return list(seen.values())


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the CPU and (if initialised) CUDA RNG states on exit."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def preserved_state(*modules: nn.Module) -> Iterator[None]:
    """Run a block that may train ``modules``; afterwards they are exactly as before."""
    params = _unique_tensors(modules, "params")
    buffers = _unique_tensors(modules, "buffers")
    # the .grad objects, and their values: a backward inside accumulates into them in place
    grads = [(p.grad, None if p.grad is None else p.grad.detach().clone()) for p in params]
    buffer_values = [b.detach().clone() for b in buffers]
    flags = [(m, m.training) for module in modules for m in module.modules()]
    held = [(m, own_tensors(m)) for module in modules for m in module.modules()]
    try:
        with preserved_rng(), paused(params):
            yield
    finally:
        for m, tensors in held:
            restore_own_tensors(m, tensors)
        with torch.no_grad():
            for p, (grad, value) in zip(params, grads):
                if grad is not None:
                    grad.copy_(value)
                p.grad = grad
            for b, v in zip(buffers, buffer_values):
                b.copy_(v)
        for m, flag in flags:
            m.training = flag
