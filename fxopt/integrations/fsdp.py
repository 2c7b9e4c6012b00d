"""A module sharded where the optimized graph never calls it: an fxopt error before any compute.

FSDP2's ``fully_shard(module)`` swaps the module's parameters for DTensor shards and gathers them
in hooks around the module's call. The optimized graph calls the root, its blocks
(``fxopt.blocks``) and the leaf modules it calls as modules, but reads every other module's
parameters directly: the layers inside a block, a block fxopt left inlined, and modules outside
the blocks that some recipes shard on their own (an export-captured model's token embeddings,
a head the chunked loss reads). A module under a leaf the graph calls as a plain module is
called by that leaf's own forward, so a shard there is gathered as on the user's model
(``fxopt.graph.graphs.graph_running``). Sharded elsewhere, the parameters are never gathered, and the forward
stops half-way with torch's "mixed torch.Tensor and DTensor" error.

``refuse_uncalled_shards`` runs in the forward pre-hook ``fxopt.optimize`` registers on the module
it returns (``fxopt.integrations.call_guard``): it raises ``ConfigError`` naming each such module
before the forward runs, and says what to shard instead. Without an initialized
``torch.distributed`` process group it returns at once; with one, it walks the module tree and the
graphs on each call. The modules a graph calls are read from the graphs themselves
(``fxopt.graph.graphs.called_paths``), so a copy, a loaded checkpoint or a replaced submodule is
judged as it is.
"""

from __future__ import annotations

import sys

import torch
from torch import fx, nn

from fxopt.core.errors import ConfigError
from fxopt.graph.graphs import called_paths, graph_running


def refuse_uncalled_shards(module: nn.Module) -> None:
    """``ConfigError`` when a module under ``module`` is sharded by FSDP2 but no graph calls it
    (module docstring)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    fsdp_module = fsdp_module_class()
    if fsdp_module is None:
        return
    sharded = [path for path, sub in module.named_modules()
               if path and isinstance(sub, fsdp_module)]
    if not sharded:
        return
    called = called_paths(module)
    uncalled = [path for path in sharded
                if path not in called and graph_running(module, path, called) is not None]
    if uncalled:
        blocks = sorted(p for p in called if p and isinstance(module.get_submodule(p),
                                                               fx.GraphModule))
        raise ConfigError(
            f"{', '.join(uncalled)} {'is' if len(uncalled) == 1 else 'are'} sharded with "
            "fully_shard, but the optimized module never calls "
            f"{'it' if len(uncalled) == 1 else 'them'}: its graph reads those parameters "
            "directly, so FSDP2 would never gather them", where=uncalled[0],
            hint="fully_shard only the blocks fxopt.blocks(module) lists "
                 f"({', '.join(blocks[:3]) + (', ...' if len(blocks) > 3 else '') or 'none'}), "
                 "then the root; the embeddings and the head are sharded with the root")


def fsdp_module_class() -> type | None:
    """FSDP2's module class (``FSDPModule``), when ``torch.distributed.fsdp`` is imported: no
    module is sharded by ``fully_shard`` otherwise, and checking for one imports nothing."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)
