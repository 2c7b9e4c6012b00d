"""Models fxopt must see before a distributed wrapper, sharding or a compiler touches them.

``fully_shard`` swaps a module's class and its parameters for DTensor shards, DDP and FSDP1 wrap
the model in a module of their own, ``torch.compile`` returns an ``OptimizedModule``: captured
from there, fxopt would trace the wrapper's machinery (or fail inside it with a torch error) and
the wrapper's promises would not carry over to the optimized module. The order that works is
the one torchtitan uses for its own rewrites: optimize the plain model, then shard, wrap or
compile the module ``fxopt.optimize`` returns (its repeated blocks stay submodules, so
``fully_shard`` per block works on it).
"""

from __future__ import annotations

import torch
from torch import nn

from fxopt.core.errors import InputError
from fxopt.core.torch_private import uncompiled

_ORDER = ("call fxopt.optimize on the plain model first, then shard, wrap or compile the module "
          "it returns (e.g. fully_shard(optimized.model.layers[i]) for each block, then "
          "fully_shard(optimized))")


def _wrapper_classes() -> dict[type, str]:
    found: dict[type, str] = {torch.nn.parallel.DistributedDataParallel: "DistributedDataParallel"}
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        found[FSDPModule] = "sharded by fully_shard (FSDP2)"
        found[FullyShardedDataParallel] = "FullyShardedDataParallel (FSDP1)"
    return found


def refuse_wrapped(model: nn.Module) -> None:
    """``InputError`` when ``model`` or one of its submodules is sharded, wrapped or compiled,
    or holds DTensor parameters or buffers."""
    classes = _wrapper_classes()
    for path, module in model.named_modules():
        if uncompiled(module) is not module:
            raise InputError(f"{type(module).__name__} is the wrapper torch.compile returned: "
                             "fxopt optimizes the plain model", where=path or "<root>",
                             hint=_ORDER)
        for cls, kind in classes.items():
            if isinstance(module, cls):
                raise InputError(f"{type(module).__name__} is {kind}: fxopt optimizes the plain "
                                 "model", where=path or "<root>", hint=_ORDER)
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, DTensor):
            raise InputError(f"{name} is a DTensor (a sharded or distributed tensor): fxopt "
                             "optimizes the plain model", where=name, hint=_ORDER)
