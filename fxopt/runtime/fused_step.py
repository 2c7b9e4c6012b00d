"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as
soon as that gradient is complete, so at most a layer's gradients are alive instead of the model's.

``FusedOptimizer`` wraps the *ordinary* optimizer the user would have built (any
``torch.optim.Optimizer``: ``AdamW(model.parameters(), lr=...)``). That optimizer keeps every
piece of state (``state``, ``param_groups``, ``defaults``), so ``state_dict()`` and
``load_state_dict()`` are the ordinary optimizer's own, in its exact format: a checkpoint saved
one way resumes the other way. The wrapper is a ``torch.optim.Optimizer`` (learning-rate
schedulers accept it) whose ``param_groups`` *is* the ordinary optimizer's list, so a scheduler's
``lr`` (and OneCycleLR's momentum or betas) reach the next per-parameter step.

How a parameter is stepped alone. ``torch.optim`` optimizers loop over ``param_groups`` and keep
their state per parameter (``state[p]``), so calling the ordinary optimizer's ``step()`` while its
group lists just ``p`` updates ``p`` exactly as the full step would: same code path, same
hyperparameters, same kernels (on CPU, and for ``foreach``/``fused`` implementations, the
per-element arithmetic is the same). The group is restored right after, also on error.

When a parameter is stepped:

- Single process: a ``register_post_accumulate_grad_hook`` per parameter. It fires once per
  backward pass, after the last contribution has been accumulated into ``.grad`` (every autograd
  node using the parameter has run). A parameter of at least ``bucket_bytes`` (1 MiB) is stepped
  there and then, and its ``.grad`` set to None; smaller ones wait in a bucket until it holds
  ``bucket_bytes`` of gradients and are stepped together (one optimizer call per bucket instead
  of one per bias: each call costs tens of microseconds of Python). The last bucket of a backward
  is stepped by ``step()``. So at most ``bucket_bytes`` of finished gradients wait at any time;
  ``bucket_bytes=0`` steps every parameter alone.
- ``accumulation_steps=N``: the hook counts the backward passes each parameter received since the
  last ``step()``; on its N-th it steps and frees. Gradients stay alive across the first N-1
  micro-batches, so memory is saved on the last micro-batch only. A parameter that received fewer
  than N (unused in some micro-batch) is stepped by ``step()``, with what it accumulated, as the
  ordinary optimizer would.
- Under ``DistributedDataParallel``: local gradients must not be used, so no accumulate hook is
  registered. A DDP communication hook all-reduces each bucket (the default averaging allreduce)
  and, in the future's ``then``, steps the bucket's parameters with the averaged gradients (a
  lock serialises buckets completing on other threads). DDP's reducer writes the averaged
  gradients back into ``.grad`` at the end of backward; ``step()`` drops them. DDP's buckets
  hold a copy of every gradient anyway, so under DDP nothing is saved in memory: the gain is the
  optimizer overlapping backward. Gradient accumulation under DDP is ``ddp.no_sync()`` for the
  first micro-batches (no all-reduce, hence no step), exactly as without fusing.

``step()`` is still called once per training step, where ``optimizer.step()`` was: it updates
nothing the hooks already updated, steps any parameter still holding a gradient that was not
applied (fewer pieces than ``accumulation_steps``, a gradient set by hand, a parameter unfrozen
after fusing), and marks the end of the step. A parameter whose gradient arrives again before
``step()`` (two backward passes per step, or a parameter reached twice in one backward by a
reentrant checkpoint) raises instead of being stepped twice. ``zero_grad()`` sets the gradients
to None, as ``zero_grad(set_to_none=True)`` does.

Raised as ``InputError`` (``fxopt.runtime.errors``) rather than silently different:
``step(closure)``,
GradScaler's ``scaler.step(fused)`` (the scaled gradients were already applied: found when the
scaler calls ``step()``, after the first step, because backward cannot tell a scaled loss), step
hooks, a second gradient before ``step()``.

Not detectable: ``torch.nn.utils.clip_grad_norm_`` called after backward sees only the last
bucket's gradients (the others were applied and freed), so it clips nothing that matters: clip
with ``clip_grad_value`` (identical to ``clip_grad_value_``) or ``max_grad_norm_per_parameter``
(each gradient on its own, not the same as a global norm). An optimizer whose ``step()`` reads
other parameters' gradients, or keeps state across parameters, computes something else when
stepped per parameter (every ``torch.optim`` optimizer but LBFGS keeps state per parameter;
``fxopt.verify.fused_training`` checks a model and optimizer).

Memory. The gradients no longer pile up, but each step allocates its own temporaries while
backward runs: torch's default for-loop AdamW two tensors the size of the parameter it steps,
``foreach=True`` one, ``fused=True`` none. So a parameter larger than ``step_slice_bytes``
(4 MiB) is stepped a slice at a time when the optimizer is SGD, Adam or AdamW (not with
``fused=True``, which needs no temporaries), whose update of an element reads nothing but that
element (``_step_in_slices``: exact, bit for bit), in at most ``MAX_STEP_SLICES`` slices: the
temporaries are a slice's (an LM's 128,256 x 2,048 bf16 head in the for-loop AdamW: 64 MiB
instead of 1 GiB).

Gradients handed over in rows. The node that computes a gradient may hand it to the step as a
function of rows instead of whole (``defer_gradient_rows``, where ``takes_gradient_rows``): when
the parameter's gradient is complete, the step computes one block of rows (``rows_per_block``:
the slices above, in whole rows), adds what autograd accumulated there (a tied embedding's
gradient), steps the block and drops it before the next. ``fxopt.runtime.chunked_loss`` does
this for a language model's head, so its vocab x hidden gradient is never made. The parameter's
accumulate hook fires even when no node returned a gradient for it (the head's own node returns
None); if it never fired, ``step()`` would step what was handed over.

Where the peak is late in backward (most gradients alive) the peak drops by about the
gradients; where it is at the end of forward (activations), the step of a big last-layer
parameter can add its temporaries to it. With activation
checkpointing (non-reentrant, as fxopt's regions are) a parameter is stepped only after every
backward node using it has run, and a region is recomputed before the first of its nodes runs,
so a recomputation never reads an updated parameter through a differentiable path.

``fused_parameters(module, fused)`` says which parameters of a module the fused optimizers
``fused`` free in backward: the memory estimate and the checkpoint planner take the fused
optimizer as an argument (``fxopt.optimize(..., fused_optimizer=fused)``), never from the set of
fused optimizers alive in the process, which only ``fuse_optimizer`` reads (to refuse fusing a
parameter twice). Inside ``paused(parameters)`` the fused optimizers of those parameters
leave backward alone: code that runs training steps it must undo (``preserved_state`` restores
gradients and buffers, not parameter values an update changed) runs there. The hooks sit on the
Parameter objects, so fusing fxopt's GraphModule also fuses the user's model that shares them.
Imports torch, the standard library and ``fxopt.runtime.errors`` only (``tests/test_layers.py``),
like all of ``fxopt.runtime``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .errors import InputError

# Every FusedOptimizer not removed: only ``fused_optimizer_of`` reads it (two fused optimizers
# on one parameter would step it twice). No estimate or plan reads it: they are given theirs.
_LIVE: weakref.WeakSet = weakref.WeakSet()
DEFAULT_BUCKET_BYTES = 2**20  # parameters smaller than this are stepped a few at a time
DEFAULT_STEP_SLICE_BYTES = 4 * 2**20  # larger parameters are stepped this many bytes at a time
# Optimizers whose update of one element reads only that element's parameter, gradient and
# state (and the group's scalars): a slice of a parameter can be stepped on its own, exactly.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# Slices start at multiples of this many elements: a vectorised kernel may compute a tail that
# is not a whole vector another way (measured with AdamW(fused=True) on CPU, which is now left
# whole), so slices cut anywhere else could round differently from the whole parameter's step.
SLICE_ALIGNMENT = 1024
# Each slice is a call of the optimizer (on a GPU, a launch per kernel of its step): a parameter
# is cut into at most this many, each then larger than step_slice_bytes where the parameter is
# (a 128,256 x 2,048 bf16 embedding: 16 slices of 32 MiB, temporaries 1/16 of the whole).
MAX_STEP_SLICES = 16
@contextlib.contextmanager
def paused(parameters: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside, the fused optimizers stepping any of ``parameters`` leave backward alone:
    gradients accumulate in ``.grad`` as without fusing, nothing is stepped. For code that runs
    training steps it must undo (fxopt's verification and measurement, under
    ``preserved_state``): a fused step would change the parameters' values, which nothing
    restores. Only those optimizers: a fused optimizer training another model (in another
    thread, say) keeps stepping, and one made inside the block works there."""
    found = {id(f): f for f in (fused_optimizer_of(p) for p in parameters) if f is not None}
    for fused in found.values():
        fused._pauses += 1
    try:
        yield
    finally:
        for fused in found.values():
            fused._pauses -= 1


def _step_after_allreduce(state, bucket):
    """DDP communication hook: average the bucket, then step its parameters (no annotations:
    DDP checks them against its own classes)."""
    return state.allreduce_then_step(bucket)


class FusedOptimizer(torch.optim.Optimizer):
    """An ordinary optimizer whose step runs per parameter inside backward.

    Built by ``fxopt.fuse_optimizer``; ``optimizer`` is the ordinary optimizer (it holds the state),
    ``module`` the model whose backward drives it (a ``DistributedDataParallel`` module makes the
    step wait for the all-reduce).
    """

    # GradScaler.step then hands the scale to step() instead of unscaling gradients it cannot
    # see (they are gone): step() refuses it with a message.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, *,
                 accumulation_steps: int = 1, clip_grad_value: float | None = None,
                 max_grad_norm_per_parameter: float | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 step_slice_bytes: int = DEFAULT_STEP_SLICE_BYTES):
        # torch.optim.Optimizer.__init__ is not called: the state is the ordinary optimizer's.
        self.optimizer = optimizer
        self.module = module
        self.accumulation_steps = accumulation_steps
        self.clip_grad_value = clip_grad_value
        self.max_grad_norm_per_parameter = max_grad_norm_per_parameter
        self.bucket_bytes = bucket_bytes
        self.step_slice_bytes = step_slice_bytes
        self.ddp = module if isinstance(module, nn.parallel.DistributedDataParallel) else None
        inner = self.ddp.module if self.ddp is not None else module
        self.names = {id(p): n for n, p in inner.named_parameters(remove_duplicate=False)}
        self.steps = 0               # step() calls so far
        self._lock = threading.RLock()
        self._pieces: dict[int, int] = {}   # id(p) -> backward passes received since step()
        self._applied: set[int] = set()     # id(p) stepped since step()
        self._pending: list[torch.Tensor] = []  # complete gradients of small parameters
        # id(p) -> what computes rows of p's gradient, one per node that handed its part over in
        # backward (``defer_gradient_rows``), stepped a block of rows at a time when p's
        # gradient is complete
        self._deferred: dict[int, list[Callable[[int, int], torch.Tensor]]] = {}
        self._pending_bytes = 0
        self._group_index: dict[int, int] = {}
        self._groups_shape: tuple[int, ...] = ()
        self._handles: list[Any] = []
        self._removed = False
        self._pauses = 0  # open paused() blocks naming this optimizer's parameters
        self._hook_parameters(self.parameters())
        if self.ddp is not None:
            self.ddp.register_comm_hook(self, _step_after_allreduce)
        _LIVE.add(self)

    # ---------------------------------------------------------------- the ordinary optimizer's
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The ordinary optimizer's ``state_dict()``: the same format, loadable by either."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by the ordinary optimizer (or by this one)."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._hook_parameters(param_group["params"] if isinstance(param_group["params"], list)
                              else [param_group["params"]])

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter the ordinary optimizer updates, in its order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InputError("a fused optimizer cannot be pickled or copied: it lives in hooks on "
                         "the model's parameters", where="FusedOptimizer (pickle, copy.deepcopy)",
                         hint="save fused.state_dict(); after loading, fuse again and "
                              "load_state_dict() it")

    def __repr__(self) -> str:
        where = "after DDP's all-reduce" if self.ddp is not None else "in backward"
        return (f"FusedOptimizer({type(self.optimizer).__name__}, {len(self.parameters())} "
                f"parameters stepped {where}, accumulation_steps={self.accumulation_steps})")

    @property
    def frees_gradients_in_backward(self) -> bool:
        """Whether every backward pass frees each gradient right after its step (no DDP, no
        accumulation): what the memory estimate may assume."""
        return not self._removed and self.ddp is None and self.accumulation_steps == 1

    # ---------------------------------------------------------------- the loop's calls
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> None:
        """End of a training step: the hooks have updated the parameters; step any parameter
        still holding a gradient not applied, and forget which ones were updated."""
        if closure is not None:
            raise InputError(
                "a fused optimizer cannot take a closure: the parameters were updated during "
                "backward, one by one", where=f"{type(self.optimizer).__name__}.step(closure)",
                hint="call step() without a closure, or train with the ordinary optimizer")
        if kwargs or getattr(self, "grad_scale", None) is not None or \
                getattr(self, "found_inf", None) is not None:
            raise InputError(
                "GradScaler cannot drive a fused optimizer: the scaled gradients were already "
                "applied in backward, and the inf/NaN check that skips a step needs every "
                "gradient before any update", where="GradScaler.step(fused optimizer)",
                hint="use bfloat16 autocast (torch.autocast(..., dtype=torch.bfloat16) needs no "
                     "GradScaler), or the ordinary optimizer with the GradScaler")
        with self._lock:
            self._flush()
            for p in self.parameters():  # a hook that never came: step them now
                if id(p) in self._deferred:
                    self._apply_rows(p, self._deferred.pop(id(p)))
            self._apply([p for p in self.parameters()
                         if p.grad is not None and id(p) not in self._applied])
            if self.ddp is not None:
                for p in self.parameters():  # DDP wrote the averaged gradients back
                    if id(p) in self._applied:
                        p.grad = None
            self._pieces.clear()
            self._applied.clear()
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the ordinary ``zero_grad``; the fused steps leave no gradient behind anyway."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._pieces.clear()
        self._pending.clear()
        self._pending_bytes = 0
        self._deferred.clear()

    def register_step_pre_hook(self, hook: Callable) -> Any:
        self._refuse_step_hooks()

    def register_step_post_hook(self, hook: Callable) -> Any:
        self._refuse_step_hooks()

    def _refuse_step_hooks(self) -> None:
        raise InputError(
            "a fused optimizer has no whole-model step to hook: each parameter is stepped on "
            "its own during backward", where="FusedOptimizer.register_step_*_hook",
            hint="hook the ordinary optimizer (fused.optimizer): its hooks then run once per "
                 "parameter step; or train with the ordinary optimizer")

    def remove(self) -> None:
        """Stop stepping in backward: the accumulate hooks go, DDP's hook just all-reduces, and
        ``self.optimizer`` is an ordinary optimizer again (with the state trained so far)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._deferred.clear()
        self._removed = True
        _LIVE.discard(self)

    # ---------------------------------------------------------------- inside backward
    def _hook_parameters(self, params: Iterable[torch.Tensor]) -> None:
        if self.ddp is not None:
            return
        for p in params:
            if p.requires_grad and p.is_leaf:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_gradient))

    @property
    def active(self) -> bool:
        """Stepping in backward now: not removed, not inside a ``paused()`` block naming its
        parameters."""
        return not self._removed and not self._pauses

    def _on_gradient(self, p: torch.Tensor) -> None:
        if not self.active:
            return
        with self._lock:
            key = id(p)
            pieces = self._pieces.get(key, 0) + 1
            self._pieces[key] = pieces
            if key in self._applied or pieces > self.accumulation_steps:
                self._second_gradient(p, pieces)
            if pieces == self.accumulation_steps:
                self._ready(p)

    def allreduce_then_step(self, bucket: Any) -> torch.futures.Future:
        """DDP's hook: the default averaging all-reduce, then a step per parameter of the bucket
        with the averaged gradient (a view into the bucket) as its ``.grad``."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        future = allreduce_hook(self.ddp.process_group, bucket)
        if not self.active:
            return future

        def then(done: torch.futures.Future) -> torch.Tensor:
            reduced, buffer = done.value(), bucket.buffer()
            if reduced.data_ptr() != buffer.data_ptr():
                buffer.copy_(reduced)
            with self._lock:
                ready = []
                for p, grad in zip(bucket.parameters(), bucket.gradients()):
                    if self._group_of(p) is None:
                        continue
                    if id(p) in self._applied:
                        self._second_gradient(p, 2)
                    p.grad = grad
                    ready.append(p)
                self._apply(ready)  # DDP's bucket is the step's bucket
            return buffer

        return future.then(then)

    def _second_gradient(self, p: torch.Tensor, pieces: int) -> None:
        name = self.names.get(id(p), "a parameter")
        raise InputError(
            f"parameter {name} received a gradient from backward pass {pieces} since the last "
            f"step(), with accumulation_steps={self.accumulation_steps}: a fused optimizer would "
            "update it twice where the ordinary optimizer sums the gradients and steps once",
            where=f"fused optimizer, gradient of {name}",
            hint="call fused.step() once per training step, after the backward (after the "
                 "accumulation_steps-th backward when accumulating); for several backward passes "
                 "per step pass accumulation_steps=N; a parameter reached twice in one backward "
                 "(torch.utils.checkpoint with use_reentrant=True around shared weights) cannot "
                 "be fused: use use_reentrant=False")

    def _group_of(self, p: torch.Tensor) -> int | None:
        """The index of ``p``'s group in the ordinary optimizer (None: not one of its)."""
        groups = self.optimizer.param_groups
        shape = tuple(len(group["params"]) for group in groups)
        if shape != self._groups_shape:  # groups added to the ordinary optimizer directly
            self._group_index = {id(q): i for i, group in enumerate(groups)
                                 for q in group["params"]}
            self._groups_shape = shape
        return self._group_index.get(id(p))

    def _ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is complete: step it now if it is big, else with the next small ones
        (fewer optimizer calls; a bucket never holds more than ``bucket_bytes`` of gradients).
        A gradient handed over in rows (``defer_gradient_rows``) is stepped now, block by
        block."""
        parts = self._deferred.pop(id(p), None)
        if parts is not None:
            self._flush()
            self._apply_rows(p, parts)
            return
        nbytes = p.numel() * p.element_size()
        if nbytes >= self.bucket_bytes:
            self._flush()  # the small ones first: freed before the big step's temporaries
            self._apply([p])
            return
        self._pending.append(p)
        self._pending_bytes += nbytes
        if self._pending_bytes >= self.bucket_bytes:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        self._apply(pending)

    def _apply(self, params: list[torch.Tensor]) -> None:
        """Step ``params`` alone with the ordinary optimizer (one call per group), then free
        their gradients. A parameter not in the optimizer is left as it is, as the ordinary
        optimizer would leave it."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            index = self._group_of(p)
            if index is not None:
                by_group.setdefault(index, []).append(p)
        if not by_group:
            return
        stepped = [p for chosen in by_group.values() for p in chosen]
        if self.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(stepped, self.clip_grad_value)
        if self.max_grad_norm_per_parameter is not None:
            for p in stepped:
                torch.nn.utils.clip_grad_norm_([p], self.max_grad_norm_per_parameter)
        for index, chosen in by_group.items():
            with _group_alone(self.optimizer, index) as group:
                whole, sliced = [], []
                for p in chosen:  # the fused kernel allocates no temporaries: nothing to slice
                    (sliced if not group.get("fused") and self._sliced(p) else whole).append(p)
                if whole:
                    _step_only(self.optimizer, group, whole)
                for p in sliced:
                    _step_in_slices(self.optimizer, group, p, self.step_slice_bytes)
            for p in chosen:
                p.grad = None
                self._applied.add(id(p))

    def _sliced(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is stepped in slices of ``step_slice_bytes`` (``_step_in_slices``)."""
        if (not self.step_slice_bytes or type(self.optimizer) not in ELEMENTWISE_OPTIMIZERS
                or p.numel() * p.element_size() <= self.step_slice_bytes):
            return False
        grad = p.grad
        if (grad is None or grad.layout != torch.strided or not p.is_contiguous()
                or not grad.is_contiguous() or grad.shape != p.shape
                or _wrapper_subclass(p.detach()) or _wrapper_subclass(grad)):
            return False
        return all(_per_element(v, p) or _scalar(v) or not isinstance(v, torch.Tensor)
                   for v in self.optimizer.state.get(p, {}).values())


    # ------------------------------------------------------- gradients handed over in rows
    def takes_gradient_rows(self, p: torch.Tensor) -> bool:
        """Whether backward may hand ``p``'s gradient to this optimizer as a function of rows
        (``defer_gradient_rows``) instead of whole: this optimizer steps ``p`` in backward now
        (active, frees gradients there), its update of an element reads only that element
        (``ELEMENTWISE_OPTIMIZERS``, and no per-parameter norm to clip by), and ``p``'s rows are
        blocks of its memory (contiguous, not a wrapper subclass, its state per element)."""
        return (self.active and self.frees_gradients_in_backward
                and self.max_grad_norm_per_parameter is None
                and type(self.optimizer) in ELEMENTWISE_OPTIMIZERS
                and p.dim() >= 1 and p.shape[0] > 0 and p.is_contiguous()
                and not _wrapper_subclass(p.detach()) and self._group_of(p) is not None
                and all(_per_element(v, p) or _scalar(v) or not isinstance(v, torch.Tensor)
                        for v in self.optimizer.state.get(p, {}).values()))

    def defer_gradient_rows(self, p: torch.Tensor,
                            rows_of: Callable[[int, int], torch.Tensor]) -> None:
        """Called in backward, where an autograd node would return a gradient for ``p``:
        ``rows_of(start, stop)`` computes rows ``start:stop`` of that contribution on demand
        (the node returns None for ``p``). When ``p``'s gradient is complete (its accumulate
        hook, after any other contribution autograd accumulated in ``p.grad``: a tied
        embedding's), ``p`` is stepped one block of rows at a time: the block's rows are
        computed, added to ``p.grad``'s, stepped, and dropped before the next block. So the
        contribution never exists whole (a language model's head: vocab x hidden). Several
        nodes of one backward may each hand theirs over (a tied embedding's lookup and head):
        their rows are summed. Only where ``takes_gradient_rows(p)``; a contribution after ``p``
        was stepped, before ``step()``, raises, as a second gradient does."""
        with self._lock:
            if id(p) in self._applied:
                self._second_gradient(p, 2)
            self._deferred.setdefault(id(p), []).append(rows_of)

    def rows_per_block(self, p: torch.Tensor) -> int:
        """Rows of ``p`` stepped at once when its gradient comes in rows: the slices
        ``_step_in_slices`` would cut (at least ``step_slice_bytes``, at most
        ``MAX_STEP_SLICES`` of them), rounded to whole rows that start at multiples of
        ``SLICE_ALIGNMENT`` elements."""
        row = max(1, p[0].numel())
        least = max(self.step_slice_bytes // p.element_size(), -(-p.numel() // MAX_STEP_SLICES))
        align = SLICE_ALIGNMENT // math.gcd(SLICE_ALIGNMENT, row)
        rows = -(-max(1, -(-least // row)) // align) * align
        return min(rows, p.shape[0])

    def _apply_rows(self, p: torch.Tensor,
                    parts: list[Callable[[int, int], torch.Tensor]]) -> None:
        """Step ``p`` block by block (``rows_per_block``), each block's gradient the sum of
        ``part(start, stop)`` over ``parts`` and what ``p.grad`` holds there; then free
        ``p.grad``."""
        index = self._group_of(p)
        accumulated, row = p.grad, max(1, p[0].numel())
        rows = self.rows_per_block(p)
        clip = self.clip_grad_value

        def blocks() -> Iterator[tuple[int, int, torch.Tensor]]:
            for start in range(0, p.shape[0], rows):
                stop = min(start + rows, p.shape[0])
                grad = accumulated[start:stop] if accumulated is not None else None
                for part in parts:
                    made = part(start, stop)
                    grad = made.to(p.dtype) if grad is None else grad.add_(made)
                    del made
                if clip is not None:
                    grad.clamp_(min=-clip, max=clip)
                yield start * row, stop * row, grad.view(-1)
                del grad

        if index is not None:
            with _group_alone(self.optimizer, index) as group:
                _step_pieces(self.optimizer, group, p, blocks())
        p.grad = None
        self._applied.add(id(p))


@contextlib.contextmanager
def _group_alone(optimizer: torch.optim.Optimizer, index: int) -> Iterator[dict[str, Any]]:
    """Inside, ``optimizer`` has only its group ``index`` (whose ``params`` the caller sets to
    what it steps); its groups and that group's parameters are restored after, also on error."""
    groups = optimizer.param_groups
    group = groups[index]
    everything = group["params"]
    optimizer.param_groups = [group]
    try:
        yield group
    finally:
        group["params"] = everything
        optimizer.param_groups = groups


def _wrapper_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass wrapping others (FSDP2's DTensor shards, quantized tensors), whose
    flat views are not its elements': stepped whole."""
    return hasattr(type(t), "__tensor_flatten__")


def _per_element(value: Any, p: torch.Tensor) -> bool:
    """A piece of optimizer state with one element per element of ``p``, laid out like it."""
    return isinstance(value, torch.Tensor) and value.shape == p.shape and value.is_contiguous()


def _scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _step_only(optimizer: torch.optim.Optimizer, group: dict[str, Any],
               params: list[torch.Tensor]) -> None:
    group["params"] = params
    optimizer.step()


def _step_in_slices(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor,
                    slice_bytes: int) -> None:
    """Step ``p`` one slice of its flattened elements at a time, so the step's temporaries are
    those of a slice (torch's for-loop AdamW allocates two tensors the size of what it steps).

    Exact for ``ELEMENTWISE_OPTIMIZERS``, whose update of an element reads only that element's
    parameter, gradient and state and the group's scalars: each slice is stepped by the ordinary
    optimizer as a parameter of its own (a leaf view of ``p``, its gradient a view of ``p.grad``)
    whose state is views of ``p``'s, so the update lands in place; scalar state (Adam's
    ``step``) is copied per slice, and every slice advances it alike, so ``p``'s copy takes the
    last slice's. On ``p``'s first step the optimizer makes each slice's state (SGD's first
    momentum is the gradient itself), which is gathered into state of ``p``'s shape."""
    grad = p.grad.view(-1)
    least = max(slice_bytes // p.element_size(), -(-p.numel() // MAX_STEP_SLICES))
    length = -(-least // SLICE_ALIGNMENT) * SLICE_ALIGNMENT
    _step_pieces(optimizer, group, p,
                 ((start, min(start + length, grad.numel()), grad[start:start + length])
                  for start in range(0, grad.numel(), length)))


def _step_pieces(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor,
                 pieces: Iterable[tuple[int, int, torch.Tensor]]) -> None:
    """Step ``p`` piece by piece: ``pieces`` yields ``(start, stop, grad)``, the flat elements
    ``start:stop`` of ``p`` (in order, covering it) and their gradient (``_step_in_slices``)."""
    state = optimizer.state
    own = state.get(p) or {}
    flat = p.detach().view(-1)
    spread: dict[str, torch.Tensor] = {}  # state of p's shape, one slice at a time
    scalars: dict[str, Any] = {}          # the rest, as the last slice left it
    order: list[str] = []
    for start, stop, grad in pieces:
        piece = flat[start:stop]
        piece.grad = grad
        given = {k: v.view(-1)[start:stop] if _per_element(v, p)
                 else v.clone() if isinstance(v, torch.Tensor) else v for k, v in own.items()}
        if own:
            state[piece] = dict(given)
        try:
            _step_only(optimizer, group, [piece])
        finally:
            made = state.pop(piece, {})
        order = list(made)
        for key, value in made.items():
            if isinstance(value, torch.Tensor) and value.shape == piece.shape and (
                    key not in own or _per_element(own[key], p)):
                if key not in spread:  # p's own state, or a new state of p's shape
                    spread[key] = (own[key].view(-1) if key in own else
                                   torch.empty(flat.numel(), dtype=value.dtype,
                                               device=value.device))
                if value is not given.get(key):  # made anew, not updated in place
                    spread[key][start:stop].copy_(value)
            else:
                scalars[key] = value
        del made, given, piece, grad
    for key in order:  # in the order the optimizer made it: state_dict() is unchanged
        if key in spread:  # p's own state was updated through its views
            own.setdefault(key, spread[key].view(p.shape))
        elif isinstance(own.get(key), torch.Tensor):
            own[key].copy_(scalars[key])
        else:
            own[key] = scalars[key]
    if own:
        state[p] = own


def rows_stepper(p: torch.Tensor) -> FusedOptimizer | None:
    """The fused optimizer step that takes ``p``'s gradient in rows
    (``FusedOptimizer.takes_gradient_rows``) where ``p`` is larger than that step's slices (a
    smaller one is stepped whole anyway); else None. For nodes deciding in forward whether to
    hand ``p``'s gradient over in backward."""
    fused = fused_optimizer_of(p)
    if fused is None or p.numel() * p.element_size() <= fused.step_slice_bytes:
        return None
    return fused if fused.takes_gradient_rows(p) else None


def hand_over_rows(stepper: FusedOptimizer | None, p: torch.Tensor,
                   rows_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor | None:
    """What a node's backward returns for ``p`` when forward chose ``stepper``
    (``rows_stepper``): None, once ``rows_of`` is handed to the step, where it still takes
    ``p``'s rows; else (paused or removed since forward) the gradient whole."""
    if stepper is not None and stepper.takes_gradient_rows(p):
        stepper.defer_gradient_rows(p, rows_of)
        return None
    return rows_of(0, p.shape[0])


def fused_optimizer_of(p: torch.Tensor) -> FusedOptimizer | None:
    """The ``FusedOptimizer`` stepping ``p`` in backward (not removed, paused or not), if any."""
    for fused in list(_LIVE):
        if fused._group_of(p) is not None:
            return fused
    return None


# What an estimate or a plan is told about the user's fused step: none, one, or several.
FusedOptimizers = FusedOptimizer | Iterable[FusedOptimizer] | None


def fused_optimizers(fused: FusedOptimizers) -> tuple[FusedOptimizer, ...]:
    """``fused`` as a tuple: None for none, one ``FusedOptimizer``, or several (a model whose
    parameters two fused optimizers share out)."""
    if fused is None:
        return ()
    found = (fused,) if isinstance(fused, FusedOptimizer) else tuple(fused)
    for item in found:
        if not isinstance(item, FusedOptimizer):
            raise InputError(f"fused_optimizer: a {type(item).__name__}, not a FusedOptimizer",
                             where="fused_optimizer=",
                             hint="pass what fxopt.fuse_optimizer returned (or several in a "
                                  "tuple), or None when the optimizer step is not fused")
    return found


def fused_parameters(module: nn.Module, fused: FusedOptimizers) -> set[torch.Tensor]:
    """The parameters of ``module`` whose gradient one of ``fused`` applies and frees during
    every backward pass (``frees_gradients_in_backward``: not removed, no DDP, no gradient
    accumulation), also while it is ``paused()``: this describes the user's training, not
    fxopt's own runs.

    For a memory estimate: such a gradient is alive from its accumulation to the end of its
    parameter's step (which allocates the step's temporaries, and on the first step the
    optimizer's state, e.g. Adam's two buffers per parameter), not to the end of backward; a
    parameter smaller than ``bucket_bytes`` waits for others, so up to ``bucket_bytes`` more
    finished gradients may be alive (the last ones until ``step()``).
    """
    ids = {id(p): p for p in module.parameters()}
    found: set[torch.Tensor] = set()
    for one in fused_optimizers(fused):
        if one.frees_gradients_in_backward:
            found.update(ids[id(p)] for p in one.parameters()
                         if id(p) in ids and p.requires_grad)
    return found
