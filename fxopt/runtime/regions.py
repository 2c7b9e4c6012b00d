"""Run a piece of a graph under activation checkpointing, without side effects on recompute.

``CheckpointedRegion(body, targets=..., selective=...)`` is what a checkpointed region of an
optimized graph calls: ``call_region(self._fxopt_region_0, x, self.conv1, self.bn1)``. The body is
code only: a GraphModule whose ``forward`` reads ``self.conv1`` & co., run with a ``RootState``
as ``self`` that holds what the root graph looked up for each of ``targets`` *in this call*. So
every parameter, buffer, submodule and constant a region uses is resolved through the root module
when the graph runs, never held by the region: ``load_state_dict(assign=True)``, ``.to()``,
replacing a Parameter, ``deepcopy`` and FSDP2's parameter swap reach the region as they reach the
rest of the graph. (A region built with ``targets=None`` runs ``body`` as a module that holds its
own state: torch.utils.checkpoint's plain behaviour, and how modules saved by fxopt 0.1 load.)

In a training forward the body runs through ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False`` (works when inputs do not require grad, with frozen parameters, under
autocast and under DistributedDataParallel) and ``preserve_rng_state=True`` (dropout masks are
replayed exactly). Recomputation uses the very objects the forward call resolved. With grad
disabled the body is just called: nothing is recomputed, but the region's inputs stay alive until
the call returns, so an inference peak can grow by one input (``tests/test_checkpoint.py``
records this as an expected failure).

Recomputation would run BatchNorm's running-statistics update a second time (PyTorch's own
checkpoint does). Here recomputation runs on copies of the buffers the region reads (the buffers
of the modules it calls, and the buffer tensors it reads directly), swapped in when it starts and
swapped out when it ends, so after one training step ``running_mean``, ``running_var`` and
``num_batches_tracked`` equal the unoptimized model's exactly. The real buffers are never written
during backward: a module called both inside and outside a region (a shared BatchNorm) keeps the
buffer its outside call saved for backward at the version autograd expects. Buffers that require
grad are left in place (recomputation must reach them) and are not shielded.

``selective=True`` keeps the outputs of convolutions and matmuls (selective activation
checkpointing) so only the cheap, memory-bound ops are recomputed. Under autocast a selective
region recomputes fully (correct, costs more time than planned).

Under ``torch.compile`` the compiled graph does the bookkeeping itself (BatchNorm's buffers are
updated once, dropout is replayed): a selective region passes SAC's contexts for the same heavy
ops, a full region none (torch's own full recomputation).

The region object is stored on the GraphModule as a plain attribute, not a submodule, and holds
no tensors: a deep copy or a pickle of it copies code, never weights.
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
# ATen ops with a leading underscore: no public promise, so looked up by name (a torch without
# one still imports this module; the op is then not kept). They are named here rather than in
# fxopt.core.torch_private because the runtime cannot import fxopt (export copies it where fxopt
# is not installed); tests/test_torch_private.py checks each exists in the installed torch.
PRIVATE_HEAVY_OPS = ("_scaled_mm", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu")
# The ops selective recomputation keeps (their outputs are saved, everything else in a selective
# region is recomputed). fxopt's cost model calls a node heavy when one of these runs inside it,
# so the planner and the run time agree on what a selective region keeps.
HEAVY_ATEN_OPS = frozenset({
    aten.convolution, aten.mm, aten.addmm, aten.bmm, aten.baddbmm,
    *(getattr(aten, name) for name in PRIVATE_HEAVY_OPS if hasattr(aten, name)),
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


class RootState:
    """What a region body reads through ``self``, as the call site resolved it for this call.

    ``self.<target>`` in the body's code gives the value passed for ``target``
    (``layers.0.weight`` is reached as ``self.layers`` -> ``"0"`` -> ``weight``).
    """

    def __init__(self, targets: tuple[str, ...], values: tuple[Any, ...]):
        self._slots: list[tuple[Any, str]] = []
        for target, value in zip(targets, values, strict=True):
            owner: Any = self
            *path, name = target.split(".")
            for item in path:
                owner = owner.__dict__.setdefault(item, _Namespace())
            owner.__dict__[name] = value
            self._slots.append((owner, name))

    def slots(self) -> list[tuple[Any, str, Any]]:
        """(owner, attribute name, value) for every value passed."""
        return [(owner, name, owner.__dict__[name]) for owner, name in self._slots]


class _Namespace:
    """One level of a target path inside ``RootState`` (``layers`` of ``layers.0.weight``)."""


def _shieldable(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
            and not value.requires_grad)


@contextlib.contextmanager
def buffers_shielded(reads: Any) -> Iterator[None]:
    """Inside: recomputation writes into copies of the buffers ``reads`` reaches.

    ``reads`` is a ``RootState`` (the buffers of the modules it holds, and the buffer tensors it
    holds directly) or a module (its buffers and its submodules').
    """
    if isinstance(reads, RootState):
        passed = reads.slots()
        modules = [value for _, _, value in passed if isinstance(value, torch.nn.Module)]
        direct = [(owner, name, value) for owner, name, value in passed if _shieldable(value)]
    else:
        modules, direct = [reads], []
    owners, seen = list(direct), set()
    for module in (m for root in modules for m in root.modules()):
        if id(module) not in seen:
            seen.add(id(module))
            owners += [(module, name, buffer)
                       for name, buffer in module.named_buffers(recurse=False)
                       if not buffer.requires_grad]
    for owner, name, buffer in owners:  # assigning a tensor to a buffer's name replaces it
        setattr(owner, name, buffer.detach().clone())
    try:
        yield
    finally:
        for owner, name, buffer in owners:
            setattr(owner, name, buffer)


@contextlib.contextmanager
def _recomputing(reads: Any, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    with buffers_shielded(reads), inner:  # copies made outside SAC's dispatch mode
        yield


def _eager_contexts(reads: Any, selective: bool
                    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint``'s ``context_fn`` in eager mode: (forward context, recompute context)."""
    if selective and not _autocast_on():
        forward, recompute = create_selective_checkpoint_contexts(_keep_heavy)
    else:
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
    return forward, _recomputing(reads, recompute)


# Under torch.compile: dynamo keeps a ``context_fn`` only if it is a plain function or a
# functools.partial of constants (a bound method loses its ``self``), and AOTAutograd requires it
# to return two TorchDispatchModes. The compiled graph updates BatchNorm's buffers once and
# replays dropout by itself, so only the choice of what to save is left: SAC for a selective
# region, torch's own full recomputation (no context_fn) for a full one.
_COMPILED_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _keep_heavy)


class CheckpointedRegion:
    """Callable that runs ``body`` checkpointed, over the state its call site passes.

    ``targets``: the qualified names (on the root module) of what the body reads through
    ``self``, in the order the call site passes their values after the body's inputs; ``None``
    for a body that is a module holding its own state.
    """

    targets: tuple[str, ...] | None = None  # regions pickled before targets existed hold state

    def __init__(self, body: torch.nn.Module, *, selective: bool,
                 targets: tuple[str, ...] | None = None):
        self.body = body
        self.selective = selective
        self.targets = None if targets is None else tuple(targets)

    def run(self, reads: Any, *inputs: Any) -> Any:
        """The body's forward on ``inputs``, reading ``reads`` (a RootState) as ``self``."""
        if self.targets is None:
            return self.body(*inputs)
        return type(self.body).forward(reads, *inputs)

    def __call__(self, *args: Any) -> Any:
        if self.targets is None:
            inputs, reads = args, self.body
        else:
            split = len(args) - len(self.targets)
            inputs, reads = args[:split], RootState(self.targets, args[split:])
        function = functools.partial(self.run, reads)
        if not torch.is_grad_enabled():
            return function(*inputs)
        if torch.compiler.is_compiling():
            selective = self.selective and not _autocast_on()
            contexts = {"context_fn": _COMPILED_SELECTIVE} if selective else {}
        else:
            contexts = {"context_fn": functools.partial(_eager_contexts, reads, self.selective)}
        return checkpoint(function, *inputs, use_reentrant=False, preserve_rng_state=True,
                          **contexts, **_SAC_HOOKS)

    def __repr__(self) -> str:
        kind = "selective" if self.selective else "full"
        graph = getattr(self.body, "graph", None)  # an exported body is plain generated code
        size = f", {len(graph.nodes)} nodes" if graph is not None else ""
        return f"CheckpointedRegion({kind}{size})"


def call_region(region: CheckpointedRegion, *args: Any) -> Any:
    """The graph's call site of a region: ``call_region(self._fxopt_region_0, x, self.conv1)``."""
    return region(*args)
