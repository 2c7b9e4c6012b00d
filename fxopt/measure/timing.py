"""Step times of two models measured side by side: the only timing figure fxopt quotes.

``timed_against(original, variant, inputs, repeats)`` runs training steps (forward + backward,
gradients cleared first) of the two models *alternately* after a warm-up, so the two medians see
the same stretch of machine noise; a ratio of the two is meaningful on a shared machine where
absolute times are not. CUDA steps are synchronized before and after each timed step.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from fxopt.core.state import preserved_state
from fxopt.core.step import training_step
from fxopt.core.tensors import module_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_training_step(module: nn.Module, inputs: tuple) -> None:
    """One training step with every ``.grad`` cleared first (as ``zero_grad(set_to_none=True)``)."""
    for p in module.parameters():
        p.grad = None
    training_step(module, inputs)


def timed_against(original: nn.Module, variant: nn.Module, inputs: tuple, repeats: int, *,
                  min_seconds: float = 1.0, max_repeats: int = 200) -> tuple[float, float]:
    """(median step seconds of ``variant``, of ``original``), timed alternately after a warm-up.

    At least ``repeats`` rounds, and more (up to ``max_repeats``) until each side has run for
    ``min_seconds`` in total: a millisecond step needs hundreds of samples to give a median that
    a noisy machine does not move.
    """
    device = module_device(original, inputs)
    times: dict[int, list[float]] = {id(original): [], id(variant): []}
    with preserved_state(original, variant):
        original.train()
        variant.train()
        for module in (original, variant):
            fresh_training_step(module, inputs)
        rounds = 0
        while rounds < repeats or (rounds < max_repeats and min(
                sum(t) for t in times.values()) < min_seconds):
            for module in (original, variant) if rounds % 2 == 0 else (variant, original):
                _sync(device)
                start = time.perf_counter()
                fresh_training_step(module, inputs)
                _sync(device)
                times[id(module)].append(time.perf_counter() - start)
            rounds += 1
    return statistics.median(times[id(variant)]), statistics.median(times[id(original)])
