"""The one definition of "a training step" used by verify, measure, analysis and benchmarks.

A step is: forward, then backward from every floating output that requires grad, seeded with
deterministic cotangents (drawn from a private generator, so the global RNG and dropout masks
are untouched). Using random cotangents rather than ``out.sum()`` makes gradient bugs visible that
a plain sum would hide (e.g. a permutation of outputs).
"""

from __future__ import annotations

from typing import Any

import torch

from fxopt.core.trees import leaves

COTANGENT_SEED = 1234


def as_args(example_inputs: Any) -> tuple:
    """Normalise example inputs to a positional-argument tuple."""
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    return (example_inputs,)


def differentiable_outputs(output: Any) -> list[torch.Tensor]:
    return [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def cotangents_for(outputs: list[torch.Tensor], seed: int = COTANGENT_SEED) -> list[torch.Tensor]:
    """Deterministic cotangents with the shape, dtype and device of each output."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(o.shape, generator=gen, dtype=torch.float32).to(device=o.device, dtype=o.dtype)
        for o in outputs
    ]


def backward_from(output: Any, seed: int = COTANGENT_SEED) -> bool:
    """Backpropagate from ``output``; returns False when nothing in it requires grad."""
    outs = differentiable_outputs(output)
    if not outs:
        return False
    torch.autograd.backward(outs, cotangents_for(outs, seed))
    return True


def training_step(module: torch.nn.Module, example_inputs: Any, seed: int = COTANGENT_SEED) -> Any:
    """One forward + backward of ``module`` on ``example_inputs``; returns the forward output."""
    output = module(*as_args(example_inputs))
    backward_from(output, seed)
    return output
