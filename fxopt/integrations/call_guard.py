"""The optimized module's run-time guard: what a script attaches to a submodule after
``fxopt.optimize`` must run as it would on the user's model, or fxopt refuses the call.

The optimized graph calls the root, its kept blocks and some leaf modules as modules; every other
module has its operations run inline (torch.fx traced through it, torch.export lowered it, a pass
replaced the call by a functional form), and a checkpointed region runs the modules it recomputes
a second time in backward. So what hangs on a module's call does not run as on the user's model:

- a module sharded with FSDP2's ``fully_shard`` that the graph never calls: its parameters are
  never gathered (``fxopt.integrations.fsdp``);
- forward pre-hooks, forward hooks and backward hooks registered on a module the graph never
  calls would never run: a feature-extraction hook (``model.layer4.register_forward_hook``),
  ``torch.nn.utils.prune``'s or ``spectral_norm``'s pre-hook, a quantization observer;
- the same hooks on a module a region recomputes would run twice a step with grad enabled (for a
  BatchNorm, whose recomputation computes batch statistics without calling it, not at all the
  second time, so an output they change would be rebuilt unchanged).

``refuse_what_would_not_run`` is the one forward pre-hook ``fxopt.optimize`` registers on the
module it returns (``guard_calls``). It raises ``ConfigError`` naming the module before any
compute. Hooks registered on the model before ``optimize`` are planned for instead: symbolic
tracing keeps a hooked module as a call, passes leave it alone and the checkpoint plan keeps it
out of its regions, so they run once a step as on the user's model. Each call walks the module
tree (about 0.8 us a module on a CPU core: 118 us for resnet50's 151 modules, 356 us for a
32-layer Llama's 423) and reads the graphs only when a submodule has hooks. The hook itself holds nothing, so deep copies, pickles and loaded
checkpoints judge the tree as it is then.

Not handled: process-wide module hooks (``register_module_forward_hook``), which belong to no
module; a hook added while the forward runs; the module ``fxopt.export`` writes, which is plain
torch code without this guard.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from fxopt.core.errors import ConfigError
from fxopt.core.modules import call_hooks, has_hooks
from fxopt.core.torch_private import forward_pre_hooks
from fxopt.graph.graphs import called_paths, recomputed_paths
from fxopt.integrations.fsdp import refuse_uncalled_shards


def guard_calls(gm: fx.GraphModule) -> None:
    """Register ``refuse_what_would_not_run`` on ``gm`` (once: a module optimized again keeps
    one)."""
    if refuse_what_would_not_run not in forward_pre_hooks(gm):
        gm.register_forward_pre_hook(refuse_what_would_not_run)


def refuse_what_would_not_run(module: nn.Module, args: Any) -> None:
    """``ConfigError`` for a shard or hooks under ``module`` that would not run as on the user's
    model (module docstring)."""
    refuse_uncalled_shards(module)
    if _any_hooked_submodule(module):
        _refuse_hooks(module)


def _any_hooked_submodule(root: nn.Module) -> bool:
    """Whether a module under ``root`` (not ``root`` itself, whose hooks are fxopt's guard and
    what the user had on the model, and run on every call) has hooks; a walk of ``_modules``,
    cheaper than ``named_modules``, which builds every path."""
    stack = list(root._modules.values())
    while stack:
        module = stack.pop()
        if module is None:  # register_module(name, None) is allowed
            continue
        if has_hooks(module):
            return True
        stack.extend(module._modules.values())
    return False


def _refuse_hooks(root: nn.Module) -> None:
    paths: dict[int, list[str]] = {}
    for path, sub in root.named_modules(remove_duplicate=False):
        if path and has_hooks(sub):
            paths.setdefault(id(sub), []).append(path)
    if not paths:
        return
    called = called_paths(root)
    recomputed = recomputed_paths(root) if torch.is_grad_enabled() else frozenset()
    sharded = _fsdp_module_class()
    for where in paths.values():
        sub = root.get_submodule(where[0])
        kinds = " and ".join(call_hooks(sub))
        name = f"{where[0]} ({type(sub).__name__})"
        if not called.intersection(where):
            raise ConfigError(
                f"{where[0]} has {kinds}, but the optimized module never calls it: its graph "
                "runs that module's operations inline, so the hooks would never run",
                where=name,
                hint="register the hooks on your model before fxopt.optimize: fxopt then keeps "
                     "the module as a call (symbolic tracing; torch.export refuses models with "
                     "hooks), and they run as on your model; or remove them (handle.remove())")
        if (recomputed.intersection(where)
                and not (sharded is not None and isinstance(sub, sharded))):
            raise ConfigError(
                f"{where[0]} has {kinds}, and the optimized module recomputes it in backward "
                "(a checkpointed region runs it again): with grad enabled the hooks would run "
                "twice a step"
                + (", and not at all in the recomputation of a BatchNorm, which computes its "
                   "statistics without calling it" if isinstance(sub, _BatchNorm) else ""),
                where=name,
                hint="register the hooks on your model before fxopt.optimize: the plan then "
                     "leaves modules with hooks out of its regions; or run the model under "
                     "torch.no_grad(), where nothing is recomputed")


def _fsdp_module_class() -> type | None:
    """FSDP2's module class when torch.distributed.fsdp is imported (no module is an FSDP2 one
    otherwise): its hooks gather parameters, in a recomputation too, as FSDP2 means them to."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)
