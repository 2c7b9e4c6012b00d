"""The optimizer step fused into backward, as a fake run sees it.

When the user has fused an optimizer into backward (``fxopt.fuse_optimizer``), each gradient of
the parameters it steps lives only from its accumulation to its parameter's step, and that step
allocates its own temporaries (the default for-loop AdamW two tensors the size of the
parameter, ``foreach=True`` one, ``fused=True`` none). A memory estimate that ignored it would
count every gradient alive to the end of backward: the planner would checkpoint for a peak that
is not there, and a budget below it would be refused.

``fused_steps_on_fakes(module, real, fakes, fused)`` makes a fake run behave the same way: for
each of the ``FusedOptimizer``s ``fused`` (given by the caller, from
``fxopt.optimize(..., fused_optimizer=...)``: the fused optimizers alive in the process are not
looked at) that frees gradients in backward (no DDP, no accumulation) and steps some of
``module``'s parameters, it builds a shadow optimizer of the *same class and hyperparameters*
over the fake parameters, creates its state before the step (the steady state of training, where
Adam's moments already exist), and fuses it into the fake backward with the same bucket size.
So the fake run allocates and frees exactly what the real fused step would, kernel for kernel, at
no real cost. It yields ``FusedStepModel``: the optimizer state bytes (alive throughout, like the
parameters: not part of the step's peak) and how many parameters are stepped in backward.

Not handled: an optimizer class whose constructor cannot be called with its own param groups
(a custom optimizer with required positional arguments), or whose step cannot run on fake
tensors from zero gradients (SparseAdam needs sparse ones): its gradients are still freed at the
step, but its temporaries and state are not counted (``FusedStepModel.temporaries_modelled`` is
False).

What the shadow steps allocate is tagged ``OPTIMIZER_STEP`` in the tracker, and every
accumulated gradient ``GRADIENT`` (``fxopt.analysis.estimate.gradients_tagged``), so the
estimate tells the step's temporaries and the gradients alive at the peak -- a fused one
included, though freed before the run ends -- from activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fxopt.analysis.memtrack import tagged
from fxopt.core.tensors import storage_bytes
from fxopt.runtime.fused_step import FusedOptimizer, FusedOptimizers, fused_optimizers


OPTIMIZER_STEP = "optimizer step"  # the tracker's tag for a fused step's temporaries


@dataclass(frozen=True)
class FusedStepModel:
    """What the fake run modelled of the user's fused optimizers."""

    parameters: int = 0               # parameters stepped (and their gradients freed) in backward
    optimizer_state_bytes: int = 0    # their optimizer's state in the steady state of training
    temporaries_modelled: bool = True  # every shadow optimizer could be built
    optimizers: tuple[str, ...] = ()  # class names, e.g. ("AdamW",)


class _FreeOnly(torch.optim.Optimizer):
    """Steps nothing: the stand-in for an optimizer the fake run cannot reproduce (its gradients
    are still freed at the step)."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__(params, {})

    def step(self, closure: object = None) -> None:
        return None


def _shadow(optimizer: torch.optim.Optimizer, fake_of: dict[int, torch.Tensor]
            ) -> torch.optim.Optimizer | None:
    """An optimizer of ``optimizer``'s class and hyperparameters over the fakes it covers, its
    state made; ``_FreeOnly`` when that cannot be had."""
    groups = []
    for group in optimizer.param_groups:
        params = [fake_of[id(p)] for p in group["params"] if id(p) in fake_of]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": params})
    if not groups:
        return None
    try:
        shadow = type(optimizer)(groups)
        _create_state(shadow)
        return shadow
    except Exception:  # a custom constructor, a step fakes cannot run: free gradients only
        for group in groups:
            for p in group["params"]:
                p.grad = None
        return _FreeOnly([p for group in groups for p in group["params"]])


def _tag_steps(shadow: torch.optim.Optimizer) -> None:
    """What ``shadow.step()`` allocates is tagged ``OPTIMIZER_STEP`` in the tracker: the step's
    temporaries are neither activations nor gradients, and checkpointing cannot remove them."""
    step = shadow.step

    def tagged_step(*args: object, **kwargs: object) -> object:
        with tagged(OPTIMIZER_STEP):
            return step(*args, **kwargs)

    shadow.step = tagged_step  # type: ignore[method-assign]


def _create_state(shadow: torch.optim.Optimizer) -> None:
    """One step from zero gradients, so the state exists before the tracked step (as in every
    training step after the first)."""
    params = [p for group in shadow.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    shadow.step()
    for p in params:
        p.grad = None


@contextlib.contextmanager
def fused_steps_on_fakes(module: nn.Module, real: dict[str, torch.Tensor],
                         fakes: dict[str, torch.Tensor],
                         fused: FusedOptimizers) -> Iterator[FusedStepModel]:
    """Inside (a fake run of ``module``, whose parameters ``real`` -- by qualified name, read
    before the swap -- are ``fakes`` now): the parameters one of ``fused`` steps in backward
    are stepped and freed the same way."""
    fake_of = {id(real[name]): fake for name, fake in fakes.items() if name in real}
    shadows: list[FusedOptimizer] = []
    state_bytes, count, modelled, names = 0, 0, True, []
    try:
        for one in fused_optimizers(fused):
            if not one.frees_gradients_in_backward:
                continue
            shadow = _shadow(one.optimizer, fake_of)
            if shadow is None:
                continue
            modelled &= not isinstance(shadow, _FreeOnly)
            _tag_steps(shadow)
            state_bytes += storage_bytes([t for s in shadow.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor)])
            shadows.append(FusedOptimizer(shadow, module, bucket_bytes=one.bucket_bytes,
                                          step_slice_bytes=one.step_slice_bytes,
                                          clip_grad_value=one.clip_grad_value,
                                          max_grad_norm_per_parameter=(
                                              one.max_grad_norm_per_parameter)))
            count += len(shadows[-1].parameters())
            names.append(type(one.optimizer).__name__)
        yield FusedStepModel(count, state_bytes, modelled, tuple(names))
    finally:
        for shadow_fused in shadows:
            shadow_fused.remove()
