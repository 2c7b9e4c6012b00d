"""Fuse an optimizer's step into backward: ``fuse_optimizer``, the public factory of
``fxopt.runtime.fused_step.FusedOptimizer`` (``fxopt.fuse_optimizer``). Proving that a fused
optimizer trains as the ordinary one does is ``fxopt.verify.fused_training``'s job.

``fuse_optimizer(model, torch.optim.AdamW, lr=1e-3)`` builds the ordinary optimizer over
``model.parameters()`` (or takes a factory ``lambda params: AdamW(params, ...)``, or an optimizer
already built, e.g. one that just loaded a checkpoint) and returns a
``fxopt.runtime.fused_step.FusedOptimizer``: from then on every backward updates each parameter
as soon as its gradient is complete and frees that gradient. The training loop keeps its shape::

    fused = fxopt.fuse_optimizer(model, torch.optim.AdamW, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(fused, T_max=100)
    for batch in loader:
        loss_fn(model(batch)).backward()    # the parameters are updated here
        fused.step()                        # ends the step (applies only what backward did not)
        fused.zero_grad()
        scheduler.step()
    torch.save(fused.state_dict(), path)    # the ordinary AdamW's state dict

The model may be the user's module, fxopt's optimized GraphModule (it holds the user's
Parameter objects), or a ``DistributedDataParallel`` module (the step waits for the all-reduce).
Hand the fused optimizer to ``fxopt.optimize(..., fused_optimizer=fused)`` (and to
``estimate_peak`` / ``max_batch_size``) so memory is planned with each gradient freed at its step.

Refused with an error naming the alternative (each is tested):

- ``max_grad_norm=``: clipping by the *global* norm needs every gradient before any update.
  ``clip_grad_value=v`` is identical to ``clip_grad_value_`` in the ordinary loop;
  ``max_grad_norm_per_parameter=c`` clips each gradient's own norm (a different, weaker rule).
  A ``clip_grad_norm_`` call left in the loop sees only the last few small gradients (the
  others are applied and freed): remove it.
- Optimizers that need every gradient at once: a ``step(closure)`` that re-evaluates the model
  (LBFGS), ``ZeroRedundancyOptimizer`` (sharded state).
- GradScaler: ``scaler.step(fused)`` raises (the scaled gradients were already applied; the
  inf check needs all of them first): use bfloat16 autocast, which needs no scaler.
- Gradient accumulation is supported: ``accumulation_steps=N`` keeps gradients across the
  first N-1 backward passes and steps on the N-th (memory is saved on the last micro-batch only).
  Under DDP it is refused in favour of ``ddp.no_sync()``, which does the same with no option.
- A distributed run (process group of several ranks) on a module that is not the DDP wrapper:
  the step would use local gradients. Fuse the DDP module, or pass ``local_gradients=True``
  when this module's gradients are not meant to be reduced.
- DDP with ``find_unused_parameters=True``: a globally unused parameter would be stepped with a
  zero gradient where plain DDP leaves it alone.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .errors import ConfigError, InputError
from .fused_step import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_STEP_SLICE_BYTES,
    FusedOptimizer,
    fused_optimizer_of,
)

OptimizerSpec = Any  # an Optimizer class, a factory ``params -> Optimizer``, or an Optimizer


def fuse_optimizer(module: nn.Module, optimizer: OptimizerSpec, /, *,
                   accumulation_steps: int = 1, clip_grad_value: float | None = None,
                   max_grad_norm: float | None = None,
                   max_grad_norm_per_parameter: float | None = None,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, local_gradients: bool = False,
                   step_slice_bytes: int = DEFAULT_STEP_SLICE_BYTES,
                   **optimizer_kwargs: Any) -> FusedOptimizer:
    """Step ``optimizer`` inside ``module``'s backward, one parameter at a time; returns the
    ``FusedOptimizer`` to call ``step()`` / ``zero_grad()`` / ``state_dict()`` on and to hand to
    learning-rate schedulers.

    ``optimizer``: a ``torch.optim.Optimizer`` class, called as
    ``optimizer(list(module.parameters()), **optimizer_kwargs)`` (so ``state_dict()`` indexes the
    parameters in ``module.parameters()`` order, as the ordinary optimizer built that way does);
    a factory called the same way (it may build its own parameter groups, e.g. over the original
    model's parameters when ``module`` is fxopt's GraphModule); or an optimizer already built
    (no ``optimizer_kwargs`` then). ``accumulation_steps``: backward passes per optimizer step.
    ``clip_grad_value`` / ``max_grad_norm_per_parameter``: per-parameter clipping before each
    step; ``max_grad_norm`` (global-norm clipping) is refused. ``bucket_bytes``: parameters
    smaller than this are stepped a few at a time, up to this many bytes of gradients (fewer
    optimizer calls); 0 steps each alone. ``step_slice_bytes``: a parameter larger than this is
    stepped in slices of that many bytes (at most 16 slices, larger where the parameter is) when
    the optimizer is SGD, Adam or AdamW without ``fused=True`` (exact: their update is per
    element), so the step's temporaries are a slice's, not the parameter's (torch's for-loop
    AdamW allocates two: for a 128,256 x 2,048 bf16 embedding, 1 GiB whole, 64 MiB sliced); 0
    steps whole parameters. ``local_gradients``: fuse in a distributed run although ``module``
    is not wrapped by DDP. ``fused.remove()`` undoes it.
    """
    if not isinstance(module, nn.Module):
        raise InputError(f"fuse_optimizer: the model is a {type(module).__name__}, not a "
                         "torch.nn.Module", hint="pass the model (or its DDP wrapper) itself")
    _check_options(accumulation_steps, clip_grad_value, max_grad_norm,
                   max_grad_norm_per_parameter, bucket_bytes, step_slice_bytes)
    ddp = isinstance(module, nn.parallel.DistributedDataParallel)
    _check_distributed(module, ddp, accumulation_steps, local_gradients)
    built = build_optimizer(module, optimizer, optimizer_kwargs)
    _check_optimizer(built)
    try:
        return FusedOptimizer(built, module, accumulation_steps=accumulation_steps,
                              clip_grad_value=clip_grad_value,
                              max_grad_norm_per_parameter=max_grad_norm_per_parameter,
                              bucket_bytes=bucket_bytes, step_slice_bytes=step_slice_bytes)
    except RuntimeError as exc:  # DDP refuses a second communication hook
        if not ddp or "comm_hook" not in str(exc):
            raise
        raise InputError("fuse_optimizer: this DDP module already has a communication hook; "
                         "the fused step needs its own (it steps after each bucket's "
                         "all-reduce)", where="DistributedDataParallel.register_comm_hook",
                         hint="wrap the model in a fresh DistributedDataParallel without a "
                              "comm hook, then fuse it") from exc


def _check_options(accumulation_steps: Any, clip_grad_value: Any, max_grad_norm: Any,
                   max_grad_norm_per_parameter: Any, bucket_bytes: Any,
                   step_slice_bytes: Any) -> None:
    if max_grad_norm is not None:
        raise ConfigError(
            "fuse_optimizer: clipping by the global gradient norm (max_grad_norm, "
            "clip_grad_norm_) needs every gradient before the first update, and a fused step "
            "updates each parameter as soon as its own gradient is ready",
            where="fuse_optimizer(max_grad_norm=...)",
            hint="use clip_grad_value=v (identical to torch.nn.utils.clip_grad_value_ in the "
                 "ordinary loop) or max_grad_norm_per_parameter=c (clips each parameter's "
                 "gradient norm on its own: not the same rule), or keep the ordinary optimizer")
    for name, value, low in (("accumulation_steps", accumulation_steps, 1),
                             ("bucket_bytes", bucket_bytes, 0),
                             ("step_slice_bytes", step_slice_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"fuse_optimizer: {name}={value!r}",
                              hint=f"pass an int >= {low}")
    for name, value in (("clip_grad_value", clip_grad_value),
                        ("max_grad_norm_per_parameter", max_grad_norm_per_parameter)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ConfigError(f"fuse_optimizer: {name}={value!r}", hint="pass a number > 0")


def _check_distributed(module: nn.Module, ddp: bool, accumulation_steps: int,
                       local_gradients: bool) -> None:
    if ddp:
        if module.find_unused_parameters:
            raise InputError(
                "fuse_optimizer: DDP with find_unused_parameters=True: a parameter no rank used "
                "would be stepped with a zero gradient, where plain DDP leaves it untouched",
                where="DistributedDataParallel(find_unused_parameters=True)",
                hint="wrap with find_unused_parameters=False (every parameter used in every "
                     "step), or keep the ordinary optimizer")
        if accumulation_steps != 1:
            raise ConfigError(
                "fuse_optimizer: accumulation_steps under DDP: DDP accumulates with no_sync()",
                where="fuse_optimizer(DistributedDataParallel, accumulation_steps=...)",
                hint="leave accumulation_steps=1 and run the first micro-batches under "
                     "`with ddp.no_sync():` (no all-reduce, so no step); the last one steps")
        return
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1 and not local_gradients:
        raise InputError(
            f"fuse_optimizer: a process group of {torch.distributed.get_world_size()} ranks is "
            f"running, and {type(module).__name__} is not a DistributedDataParallel module: the "
            "fused step would use each rank's local gradient, before any all-reduce",
            where=f"fuse_optimizer({type(module).__name__})",
            hint="fuse the DDP wrapper: fuse_optimizer(DistributedDataParallel(model), ...); pass "
                 "local_gradients=True if this module's gradients are not meant to be reduced")


def build_optimizer(module: nn.Module, optimizer: OptimizerSpec, kwargs: dict) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        if kwargs:
            raise ConfigError(f"fuse_optimizer: keyword arguments {sorted(kwargs)} with an "
                              "optimizer already built", hint="build it with them, or pass its "
                              "class and the arguments")
        return optimizer
    if not callable(optimizer):
        raise InputError(f"fuse_optimizer: the optimizer is a {type(optimizer).__name__}",
                         hint="pass a torch.optim.Optimizer class (torch.optim.AdamW), a factory "
                              "`lambda params: AdamW(params, lr=...)`, or an optimizer")
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        _check_optimizer_class(optimizer)
    built = optimizer(list(module.parameters()), **kwargs)
    if not isinstance(built, torch.optim.Optimizer):
        raise InputError(f"fuse_optimizer: the factory returned a {type(built).__name__}, not a "
                         "torch.optim.Optimizer", hint="return the optimizer it builds")
    return built


def _check_optimizer_class(cls: type) -> None:
    step = inspect.signature(cls.step).parameters.get("closure")
    if step is not None and step.default is inspect.Parameter.empty:
        raise InputError(
            f"fuse_optimizer: {cls.__name__} needs every gradient at once: its step(closure) "
            "re-evaluates the whole model (and keeps state over all parameters together)",
            where=f"{cls.__module__}.{cls.__name__}",
            hint="use a per-parameter optimizer (SGD, Adam, AdamW, ...), or keep "
                 f"{cls.__name__} as an ordinary optimizer")
    if cls.__name__ == "ZeroRedundancyOptimizer" or issubclass(cls, FusedOptimizer):
        what = ("shards the optimizer state across ranks and steps each rank's shard together"
                if cls.__name__ == "ZeroRedundancyOptimizer" else "is fused already")
        raise InputError(f"fuse_optimizer: {cls.__name__} {what}",
                         where=f"{cls.__module__}.{cls.__name__}",
                         hint="fuse the ordinary per-parameter optimizer (e.g. torch.optim.AdamW) "
                              "instead; under DDP the fused step already overlaps the all-reduce")


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    _check_optimizer_class(type(optimizer))
    for group in optimizer.param_groups:
        for p in group["params"]:
            other = fused_optimizer_of(p)
            if other is not None and other.active:
                raise InputError("fuse_optimizer: a parameter is already stepped by another "
                                 "fused optimizer", where=f"parameter of shape {tuple(p.shape)}",
                                 hint="call .remove() on the first fused optimizer, or fuse one "
                                      "optimizer over all the parameters")
