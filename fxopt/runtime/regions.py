"""Run a piece of a graph under activation checkpointing, without side effects on recompute.

``CheckpointedRegion(body, selective=...)`` is what a checkpointed region of an optimized graph
calls. In a training forward it runs ``body`` through ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False`` (works when inputs do not require grad, with frozen parameters, under
autocast and under DistributedDataParallel) and ``preserve_rng_state=True`` (dropout masks are
replayed exactly). With grad disabled it just calls ``body``: nothing is recomputed, but the
region's inputs stay alive until the call returns, so an inference peak can grow by one input
(``tests/test_checkpoint.py`` records this as an expected failure).

Recomputation would run BatchNorm's running-statistics update a second time (PyTorch's own
checkpoint does). Here recomputation runs on copies of the buffers the region's modules own,
swapped in when it starts and swapped out when it ends, so after one training step
``running_mean``, ``running_var`` and ``num_batches_tracked`` equal the unoptimized model's
exactly. The real buffers are never written during backward: a module called both inside and
outside a region (a shared BatchNorm) keeps the buffer its outside call saved for backward at the
version autograd expects. Buffers that require grad are left in place (recomputation must reach
them) and are not shielded.

``selective=True`` keeps the outputs of convolutions and matmuls (selective activation
checkpointing) so only the cheap, memory-bound ops are recomputed. Under autocast a selective
region recomputes fully (correct, costs more time than planned).

Under ``torch.compile`` the compiled graph does the bookkeeping itself (BatchNorm's buffers are
updated once, dropout is replayed): a selective region passes SAC's contexts for the same heavy
ops, a full region none (torch's own full recomputation).

The region object is stored on the GraphModule as a plain attribute, not a submodule: the
parameters it uses stay registered once, under their original names.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

aten = torch.ops.aten
# The ops selective recomputation keeps (their outputs are saved, everything else in a selective
# region is recomputed). fxopt's cost model calls a node heavy when one of these runs inside it,
# so the planner and the run time agree on what a selective region keeps.
HEAVY_ATEN_OPS = frozenset({
    aten.convolution, aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu,
})


def is_heavy(op: Any) -> bool:
    """Whether the ATen op (an overload such as ``aten.mm.default``) is one of HEAVY_ATEN_OPS."""
    return getattr(op, "overloadpacket", op) in HEAVY_ATEN_OPS


# Let saved-tensor hooks (save_on_cpu, fxopt's own saved-tensor analysis) see what SAC keeps,
# where this torch supports choosing it.
_SAC_HOOKS = ({"respect_saved_tensors_hooks": True}
              if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


def _keep_heavy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_heavy(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _autocast_on() -> bool:
    """Under autocast the weight-cast cache makes recompute run casts forward skipped, which
    selective checkpointing rejects; such regions recompute fully instead."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


@contextlib.contextmanager
def buffers_shielded(body: torch.nn.Module) -> Iterator[None]:
    """Recomputation inside this context writes into copies of the region's buffers."""
    owners = [(module, name, buffer) for module in body.modules()
              for name, buffer in module.named_buffers(recurse=False)
              if not buffer.requires_grad]
    for module, name, buffer in owners:  # assigning a tensor to a buffer's name replaces it
        setattr(module, name, buffer.detach().clone())
    try:
        yield
    finally:
        for module, name, buffer in owners:
            setattr(module, name, buffer)


@contextlib.contextmanager
def _recomputing(body: torch.nn.Module, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    with buffers_shielded(body), inner:  # copies made outside SAC's dispatch mode
        yield


def _eager_contexts(body: torch.nn.Module, selective: bool
                    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint``'s ``context_fn`` in eager mode: (forward context, recompute context)."""
    if selective and not _autocast_on():
        forward, recompute = create_selective_checkpoint_contexts(_keep_heavy)
    else:
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
    return forward, _recomputing(body, recompute)


# Under torch.compile: dynamo keeps a ``context_fn`` only if it is a plain function or a
# functools.partial of constants (a bound method loses its ``self``), and AOTAutograd requires it
# to return two TorchDispatchModes. The compiled graph updates BatchNorm's buffers once and
# replays dropout by itself, so only the choice of what to save is left: SAC for a selective
# region, torch's own full recomputation (no context_fn) for a full one.
_COMPILED_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _keep_heavy)


class CheckpointedRegion:
    """Callable that runs ``body`` (a GraphModule over the user's modules) checkpointed."""

    def __init__(self, body: fx.GraphModule, *, selective: bool):
        self.body = body
        self.selective = selective

    def __call__(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body(*args)
        if torch.compiler.is_compiling():
            selective = self.selective and not _autocast_on()
            contexts = {"context_fn": _COMPILED_SELECTIVE} if selective else {}
        else:
            contexts = {"context_fn": functools.partial(_eager_contexts, self.body, self.selective)}
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True,
                          **contexts, **_SAC_HOOKS)

    def __repr__(self) -> str:
        kind = "selective" if self.selective else "full"
        graph = getattr(self.body, "graph", None)  # an exported body is plain generated code
        size = f", {len(graph.nodes)} nodes" if graph is not None else ""
        return f"CheckpointedRegion({kind}{size})"


def call_region(region: CheckpointedRegion, *args: Any) -> Any:
    """The graph's call site of a region: ``call_region(self._fxopt_region_0, x, y)``."""
    return region(*args)
