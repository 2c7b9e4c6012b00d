"""``ZooEntry`` and the helpers that make every zoo entry deterministic.

Builders run under ``torch.random.fork_rng`` with only the CPU generator re-seeded, so a build
gives the same weights every time and leaves the global CPU RNG exactly as it found it. CUDA RNG
state is never touched (``torch.manual_seed`` would also seed CUDA, so it is not used). Example
inputs come from a private ``torch.Generator``; the global RNG is not consulted at all.

Not handled: builders that draw randomness from anything but the torch CPU generator (Python's
``random``, NumPy) would not be deterministic; no zoo model does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxopt.core.errors import InputError

BUILD_SEED = 0
INPUT_SEED = 0


@dataclass(frozen=True)
class ZooEntry:
    """A named reference model: how to build it and how to feed it."""

    name: str
    build: Callable[[], nn.Module]
    example_inputs: Callable[[int], tuple]
    default_batch: int
    description: str
    tags: frozenset[str]


def seeded_builder(factory: Callable[[], nn.Module],
                   seed: int = BUILD_SEED) -> Callable[[], nn.Module]:
    """Wrap ``factory``: each call returns a fresh, identically initialised module in train mode."""

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            model = factory()
        return model.train()

    return build


def checked_batch(batch_size: int) -> int:
    """Return ``batch_size`` if it is a positive int, else raise InputError."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"zoo example inputs need a positive integer batch size, "
                         f"got {batch_size!r}",
                         where="models_zoo example_inputs",
                         hint="pass a batch size of 1 or more")
    return batch_size


def float_inputs(*shape: int, seed: int = INPUT_SEED) -> Callable[[int], tuple]:
    """Example inputs: one standard-normal float32 tensor of shape ``(batch, *shape)``."""

    def make(batch_size: int) -> tuple:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn((checked_batch(batch_size), *shape), generator=gen),)

    return make


def token_inputs(seq_len: int, vocab_size: int, seed: int = INPUT_SEED) -> Callable[[int], tuple]:
    """Example inputs: one int64 tensor ``(batch, seq_len)`` of token ids in ``[0, vocab_size)``."""

    def make(batch_size: int) -> tuple:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab_size, (checked_batch(batch_size), seq_len), generator=gen),)

    return make


def zoo_entry(name: str, factory: Callable[[], nn.Module],
              example_inputs: Callable[[int], tuple], *,
              default_batch: int, description: str, tags: Sequence[str]) -> ZooEntry:
    """A ZooEntry whose ``build`` is ``factory`` made deterministic by ``seeded_builder``."""
    return ZooEntry(name=name, build=seeded_builder(factory), example_inputs=example_inputs,
                    default_batch=default_batch, description=description, tags=frozenset(tags))
