"""Step times of two models measured side by side: the only timing figure fxopt quotes.

``timed_against(original, variant, inputs, repeats)`` runs training steps (forward + backward,
gradients cleared first) of the two models *alternately* after a warm-up, so the two medians see
the same stretch of machine noise; a ratio of the two is meaningful on a shared machine where
absolute times are not. CUDA steps are synchronized before and after each timed step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

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


def alternated_samples(modules: Sequence[nn.Module], inputs: tuple, repeats: int, *,
                       min_seconds: float = 1.0, max_repeats: int = 200) -> list[list[float]]:
    """Seconds of each training step of each of ``modules``, timed in rounds whose order rotates
    (two modules: alternately), after one warm-up step each (lazy state, compiled code, caches).

    At least ``repeats`` rounds, and more (up to ``max_repeats``) until every module has run for
    ``min_seconds`` in total: a millisecond step needs hundreds of samples to give a median that
    a noisy machine does not move. Grads, buffers, training flags and the RNG are as before.
    """
    device = module_device(modules[0], inputs)
    times: list[list[float]] = [[] for _ in modules]
    with preserved_state(*modules):
        for module in modules:
            module.train()
            fresh_training_step(module, inputs)
        rounds = 0
        while rounds < repeats or (rounds < max_repeats and min(map(sum, times)) < min_seconds):
            for offset in range(len(modules)):
                index = (rounds + offset) % len(modules)
                _sync(device)
                start = time.perf_counter()
                fresh_training_step(modules[index], inputs)
                _sync(device)
                times[index].append(time.perf_counter() - start)
            rounds += 1
    return times


def timed_against(original: nn.Module, variant: nn.Module, inputs: tuple, repeats: int, *,
                  min_seconds: float = 1.0, max_repeats: int = 200) -> tuple[float, float]:
    """(median step seconds of ``variant``, of ``original``), timed alternately
    (``alternated_samples``)."""
    original_times, variant_times = alternated_samples(
        [original, variant], inputs, repeats, min_seconds=min_seconds, max_repeats=max_repeats)
    return statistics.median(variant_times), statistics.median(original_times)
