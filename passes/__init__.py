"""The pass registry, in canonical order.

Passes run in this order whatever order the user lists them in would suggest; a user-given list
that is out of order is a ConfigError naming the order (a silent reordering would hide that, e.g.,
checkpointing decisions were taken on an unpadded graph).

Each entry: the canonical name, accepted short aliases, the pass function, whether it is in the
default pipeline, and a one-line summary for the CLI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxopt.rewrite.pass_base import PassResult


@dataclass(frozen=True)
class PassSpec:
    name: str
    run: Callable[..., PassResult]
    summary: str
    default: bool = True
    aliases: tuple[str, ...] = ()


REGISTRY: dict[str, PassSpec] = {}


def register(spec: PassSpec) -> None:
    REGISTRY[spec.name] = spec


def canonical_order() -> list[str]:
    return list(REGISTRY)


def lookup(name: str) -> PassSpec | None:
    for spec in REGISTRY.values():
        if name == spec.name or name in spec.aliases:
            return spec
    return None


def _register_builtin() -> None:
    from passes.checkpoint import checkpoint
    from passes.inplace_activations import inplace_activations
    from passes.pad_channels import pad_channels
    from passes.reorder import reorder

    register(PassSpec("pad_channels", pad_channels,
                      "pad channel/feature sizes to multiples of 8 where aligned kernels are "
                      "faster (CUDA half/bfloat16/TF32; force=true elsewhere)",
                      aliases=("pad",)))
    register(PassSpec("inplace_activations", inplace_activations,
                      "make activations in-place where autograd does not need the input",
                      aliases=("inplace",)))
    register(PassSpec("checkpoint", checkpoint,
                      "recompute the cheapest regions in backward to fit a memory budget",
                      default=False, aliases=("ckpt",)))
    register(PassSpec("reorder", reorder,
                      "memory-aware topological order (lowest predicted peak)"))


_register_builtin()
