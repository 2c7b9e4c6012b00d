"""A language model's head and token-level cross-entropy, computed over chunks of tokens.

``passes.chunked_loss`` rewrites ``loss = cross_entropy(logits_path(linear(hidden, W, b)),
targets)`` into ``chunked_loss(hidden, W, b, targets, ...)`` (or ``chunked_loss_and_logits``
when the logits are also used, e.g. returned). The batch x sequence x vocab tensors of the
original (the saved log-softmax, its gradient, the logits' gradient) never exist: for each chunk of
``chunk_rows`` tokens (``auto_chunk_rows`` when the graph leaves it None) the forward computes the chunk's logits, its part of the loss, and the
gradient of the loss with respect to the chunk's logits, and folds that gradient straight into the
gradients for ``hidden`` (one row block) and ``W`` (accumulated in place, ``addmm_``) and ``b``.
Only those are kept for backward (the approach of Liger's fused linear cross-entropy), which
scales them by the incoming gradient of the loss: exact, because the loss is a scalar.

What the call reproduces, exactly as ``torch.nn.functional.cross_entropy`` computes it:

- ``reduction="mean"``: the sum over tokens whose target is not ``ignore_index``, divided by
  their number in the *whole* call (not per chunk); no such token at all gives NaN and zero
  gradients, as cross_entropy does. ``reduction="sum"``: the sum.
- ``label_smoothing``: ``(1 - e) * nll + e * mean_j(-log_softmax_j)`` per token.
- ``transforms``: the element-wise ops between the projection and the loss, in order:
  ``("to", dtype)`` (an upcast), ``("mul", c)``, ``("div", c)`` (logit scaling), ``("tanh",)``
  (with a mul and a div around it: Gemma 2's logit soft-cap).
- ``row_slices``: ``(dim, start, stop, step)`` slices of the logits' leading dimensions taken
  before the loss (Hugging Face's older causal shift, ``logits[..., :-1, :]``). ``targets`` are
  then the targets of the sliced rows; the other rows count as ignored.

Under autocast, the loss is computed in float32 as autocast computes ``cross_entropy``; a weight
gradient in another dtype than the chunk's logit gradient is accumulated through one temporary
per chunk instead of in place. The logits returned by ``chunked_loss_and_logits`` are the
projection's output after the first ``logits_transforms`` of ``transforms`` (what the model
returned: Hugging Face's upcast, Gemma 2's soft-cap), written chunk by chunk; a gradient through
them (distillation) reaches ``hidden``, ``W`` and ``b`` in backward, rebuilding each chunk's
logits there when the transforms need them. Without grad (or when no input requires it) the
call computes the loss alone, chunk by chunk. ``CHUNKED_LOSS_CALLS``: the functions a graph
calls, which ``fxopt.capture.trace`` records as calls when an optimized module is traced again.

With a fused optimizer step (``fxopt.fuse_optimizer``) that takes the weight's gradient in rows
(``FusedOptimizer.takes_gradient_rows``; a weight larger than its ``step_slice_bytes``, no
autocast, no logits returned), forward does not accumulate that gradient: it keeps each token's
log-sum-exp (and a copy of the bias, which its own step may update first), and backward hands the
step a function that recomputes rows of the weight's gradient from the hidden states over chunks
of tokens (Apple's Cut Cross-Entropy's way). The vocab x hidden gradient is never made; it costs
one more projection of the hidden states onto the vocabulary, in backward. Where the step is
paused (fxopt's own runs) or gone by backward, the gradient is made whole as before.

Not handled: class weights, ``reduction="none"``, probability targets (the pass refuses them).
A second backward through the same call (``retain_graph=True``) raises autograd's error about a
tensor modified in place: backward scales the kept gradients in place, so no second copy of the
head's weight gradient is ever made. Under ``create_graph=True`` the gradients are not
differentiable again (``once_differentiable``).

``LogitsNotComputed``: what an output that held the logits holds in a training step after a
rewrite with ``outputs="loss"`` (the caller reads only the loss; ``logits_unless_grad``): using
it raises an error that says why. With grad disabled the logits are computed as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .devices import autocast_dtype
from .fused_step import hand_over_rows, rows_stepper

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# Inside fxopt's fake-tensor runs, which observe memory and shapes but no values, the chunk
# loops run their first two chunks and their last (``chunks_sampled``): every chunk in between
# allocates, overlaps its predecessor and frees exactly as the second does (the temporaries are
# reassigned each iteration; the kept gradients and the logits are written in place), so the
# peak, the saved tensors and the shapes are those of the whole loop, at a fraction of the fake
# dispatches (a 2,048-token loss at 16-token chunks is 128 chunks).
_CHUNKS_SAMPLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fxopt_chunked_loss_chunks_sampled", default=False)


@contextlib.contextmanager
def chunks_sampled() -> Iterator[None]:
    """Inside (in this context only): chunk loops run chunks 0, 1 and the last (see above)."""
    token = _CHUNKS_SAMPLED.set(True)
    try:
        yield
    finally:
        _CHUNKS_SAMPLED.reset(token)


def chunk_starts(rows: int, size: int) -> Sequence[int]:
    """Where the chunks of ``size`` rows start, every one, or the three ``chunks_sampled``
    keeps."""
    starts = range(0, rows, size)
    if len(starts) > 3 and _CHUNKS_SAMPLED.get():
        return (starts[0], starts[1], starts[-1])
    return starts


MIN_CHUNK_ROWS = 16
TARGET_CHUNK_BYTES = 8 * 2**20


def floor_pow2(n: int) -> int:
    """The largest power of two at most ``n`` (1 for n < 2)."""
    return 1 << max(0, int(n).bit_length() - 1)


def auto_chunk_rows(tokens: int, vocab: int, hidden: int, itemsize: int) -> int:
    """Tokens per chunk when the graph leaves the size open (``chunk_rows=None``): large enough
    that each chunk's matmuls stay efficient, small enough that the chunk's temporaries are a
    small part of what chunking removes: the rows whose chunk x vocab logits are as large as the
    larger of the hidden states (already alive at that point, Liger's rule) and
    ``TARGET_CHUNK_BYTES``, as a power of two, at least ``MIN_CHUNK_ROWS``, at most ``tokens``."""
    target = max(tokens * hidden * itemsize, TARGET_CHUNK_BYTES)
    rows = max(MIN_CHUNK_ROWS, floor_pow2(max(1, target // (vocab * itemsize))))
    return max(1, min(rows, tokens))


class LogitsNotComputed:
    """Stands where a model returned its logits, after ``chunked_loss(outputs="loss")``."""

    __slots__ = ("what",)
    # how fxopt.verify recognises it, and the copies of this class an exported module holds
    fxopt_not_computed = True

    def __init__(self, what: str = "logits"):
        object.__setattr__(self, "what", what)

    def _message(self) -> str:
        return (f"the model's {self.what} were not computed: it was optimized with "
                "passes=[..., ('chunked_loss', {'outputs': 'loss'})], which computes the loss "
                "in chunks and never builds the full logits; optimize without outputs='loss' "
                "to get them, or call the model under torch.no_grad()")

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(self._message())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(self._message())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = next((a for a in (*args, *(kwargs or {}).values())
                      if isinstance(a, LogitsNotComputed)), cls())
        raise RuntimeError(found._message())

    def __getitem__(self, key: Any) -> Any:
        raise RuntimeError(self._message())

    def __iter__(self) -> Any:
        raise RuntimeError(self._message())

    def __len__(self) -> int:
        raise RuntimeError(self._message())

    def __bool__(self) -> bool:
        raise RuntimeError(self._message())

    def __repr__(self) -> str:
        return f"LogitsNotComputed({self.what!r})"

    def __reduce__(self) -> Any:
        return (LogitsNotComputed, (self.what,))

    def __deepcopy__(self, memo: dict) -> LogitsNotComputed:
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogitsNotComputed) and other.what == self.what

    def __hash__(self) -> int:
        return hash(("LogitsNotComputed", self.what))


def logits_unless_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       *, transforms: tuple = ()) -> torch.Tensor | LogitsNotComputed:
    """What an ``outputs="loss"`` graph returns where the model returned its logits: with grad
    enabled (a training step) a ``LogitsNotComputed``; with grad disabled (evaluation under
    ``torch.no_grad()``, where nothing is saved for backward) the logits as the model computed
    them, ``transforms(linear(hidden, weight, bias))``."""
    if torch.is_grad_enabled():
        return LogitsNotComputed("logits")
    logits = F.linear(hidden, weight, bias)
    logits, _ = _forward_transforms(logits, tuple(transforms), need_grad=False)
    return logits


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 targets: torch.Tensor, *, chunk_rows: int | None = None,
                 ignore_index: int = -100,
                 label_smoothing: float = 0.0, reduction: str = "mean",
                 transforms: tuple = (), row_slices: tuple = ()) -> torch.Tensor:
    """``cross_entropy(transforms(linear(hidden, weight, bias))[row_slices].flatten, targets)``
    over chunks of ``chunk_rows`` tokens (None: ``auto_chunk_rows``); the logits are never
    built whole."""
    options = (None if chunk_rows is None else int(chunk_rows), ignore_index,
               float(label_smoothing), reduction,
               tuple(transforms), tuple(row_slices), None)
    return _ChunkedLinearCrossEntropy.apply(*_as_grad_mode_needs(hidden, weight, bias),
                                            targets, options)[0]


def chunked_loss_and_logits(hidden: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None, targets: torch.Tensor, *,
                            chunk_rows: int | None = None, ignore_index: int = -100,
                            label_smoothing: float = 0.0, reduction: str = "mean",
                            transforms: tuple = (), row_slices: tuple = (),
                            logits_transforms: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_loss``, and the logits after the first ``logits_transforms`` of
    ``transforms`` (the whole logits, written chunk by chunk), differentiable through both."""
    options = (None if chunk_rows is None else int(chunk_rows), ignore_index,
               float(label_smoothing), reduction,
               tuple(transforms), tuple(row_slices), int(logits_transforms))
    loss, logits = _ChunkedLinearCrossEntropy.apply(*_as_grad_mode_needs(hidden, weight, bias),
                                                    targets, options)
    return loss, logits


def _as_grad_mode_needs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` detached where grad is disabled (``torch.no_grad``, inference mode).

    A Function's ``ctx.needs_input_grad`` follows its inputs' ``requires_grad`` whatever the
    grad mode, so an evaluation under ``torch.no_grad()`` would make every gradient in forward,
    three matmuls of the head instead of one, and hold a weight-sized gradient while it ran.
    Under no grad nothing is differentiated: the detached inputs are the same values."""
    if torch.is_grad_enabled():
        return tensors
    return tuple(None if t is None else t.detach() for t in tensors)


# what an optimized graph calls: recorded as calls, not traced through, when it is traced again
CHUNKED_LOSS_CALLS = (chunked_loss, chunked_loss_and_logits, logits_unless_grad)


def full_targets(targets: torch.Tensor, lead: torch.Size, row_slices: tuple,
                 ignore_index: int) -> torch.Tensor:
    """One target per row of the unsliced logits (flattened): ``ignore_index`` where the loss
    did not look."""
    if not row_slices:
        return targets.reshape(-1)
    full = targets.new_full(tuple(lead), ignore_index)
    view = full
    for dim, start, stop, step in row_slices:
        view = view[(slice(None),) * dim + (slice(start, stop, step),)]
    view.copy_(targets.reshape(view.shape))
    return full.reshape(-1)


def _forward_transforms(z: torch.Tensor, transforms: tuple, need_grad: bool
                        ) -> tuple[torch.Tensor, list[tuple[str, Any]]]:
    """``transforms`` applied to ``z`` (a temporary this function may overwrite), and what
    their backward needs."""
    steps: list[tuple[str, Any]] = []
    y = z
    for transform in transforms:
        kind = transform[0]
        if kind == "to":
            steps.append(("to", y.dtype))
            y = y.to(transform[1])
        elif kind == "mul":
            y = y.mul_(transform[1])
            steps.append(("mul", transform[1]))
        elif kind == "div":
            y = y.div_(transform[1])
            steps.append(("div", transform[1]))
        elif kind == "tanh":
            y = y.tanh_()
            steps.append(("tanh", (1 - y.square()) if need_grad else None))
        else:
            raise ValueError(f"chunked_loss: unknown logit transform {transform!r}")
    return y, steps


def _backward_transforms(grad: torch.Tensor, steps: list[tuple[str, Any]]) -> torch.Tensor:
    for kind, value in reversed(steps):
        if kind == "to":
            grad = grad.to(value)
        elif kind == "mul":
            grad = grad.mul_(value)
        elif kind == "div":
            grad = grad.div_(value)
        else:  # tanh: value is 1 - tanh(x)^2
            grad = grad.mul_(value)
    return grad


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Inputs ``hidden, weight, bias, targets, options``; outputs ``(loss, logits or None)``.
    ``options``: ``(chunk_rows, ignore_index, label_smoothing, reduction, transforms,
    row_slices, logits_transforms)``, the last None when no logits are returned."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, options: tuple) -> Any:
        rows_per_chunk, ignore_index, smoothing, reduction, transforms, row_slices, keep = options
        if reduction not in ("mean", "sum"):
            raise ValueError(f"chunked_loss: reduction {reduction!r} is not 'mean' or 'sum'")
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        need_grad = need_h or need_w or need_b
        autocast = autocast_dtype(hidden.device.type) is not None
        size, vocab = hidden.shape[-1], weight.shape[0]
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, size)
        rows = flat.shape[0]
        if rows_per_chunk is None:
            rows_per_chunk = auto_chunk_rows(rows, vocab, size, weight.element_size())
        target = full_targets(targets, lead, row_slices, ignore_index)
        if target.numel() != rows:
            raise ValueError(f"chunked_loss: {target.numel()} targets for {rows} rows of logits")
        valid = target != ignore_index
        count = valid.sum()
        grad_h = torch.empty_like(flat) if need_h else None
        # the weight's gradient handed to its fused optimizer step in rows, computed there
        stepper = rows_stepper(weight) if need_w and keep is None and not autocast else None
        grad_w = torch.zeros_like(weight) if need_w and stepper is None else None
        grad_b = torch.zeros_like(bias) if need_b else None
        out_dtype = _loss_dtype(flat, weight, transforms, autocast)
        total = torch.zeros((), dtype=torch.promote_types(out_dtype, torch.float32),
                            device=hidden.device)
        grad_scale = None
        if reduction == "mean":
            grad_scale = torch.where(count > 0, 1.0 / count.to(total.dtype), 0.0)
        prefix, rest = transforms[:keep or 0], transforms[keep or 0:]
        logits = None
        lse_rows = None
        for start in chunk_starts(rows, max(1, rows_per_chunk)):
            stop = min(start + max(1, rows_per_chunk), rows)
            h = flat[start:stop]
            z = F.linear(h, weight, bias)
            y, steps = _forward_transforms(z, prefix, need_grad)
            if keep is not None:
                if logits is None:
                    logits = y.new_empty((rows, vocab))
                logits[start:stop].copy_(y)
            y, more = _forward_transforms(y, rest, need_grad)
            steps += more
            if autocast and y.dtype in _LOW_PRECISION:  # as autocast runs cross_entropy
                steps.append(("to", y.dtype))
                y = y.float()
            t, ok = target[start:stop], valid[start:stop]
            safe = t.masked_fill(~ok, 0).unsqueeze(1)
            lse = torch.logsumexp(y, dim=1)
            if stepper is not None:
                if lse_rows is None:
                    lse_rows = lse.new_empty(rows)
                lse_rows[start:stop].copy_(lse)
            row = lse - y.gather(1, safe).squeeze(1) * (1.0 - smoothing)
            if smoothing:
                row = row - y.mean(dim=1) * smoothing
            total += torch.where(ok, row, 0).sum(dtype=total.dtype)
            if not need_grad:
                continue
            # d loss / d y = softmax(y) - (1 - e) * onehot(t) - e / V on counted rows, scaled
            grad = y.sub_(lse.unsqueeze(1)).exp_()
            grad.scatter_add_(1, safe, torch.full_like(safe, smoothing - 1.0, dtype=grad.dtype))
            if smoothing:
                grad.sub_(smoothing / vocab)
            scale = ok.to(grad.dtype) if grad_scale is None else ok.to(grad.dtype) * grad_scale
            grad.mul_(scale.unsqueeze(1))
            _accumulate(_backward_transforms(grad, steps).to(z.dtype), h, weight,
                        grad_h[start:stop] if need_h else None, grad_w, grad_b)
        if logits is None and keep is not None:
            logits = F.linear(flat[:0], weight, bias).new_empty((0, vocab))
        loss = (total / count if reduction == "mean" else total).to(out_dtype)
        kept = [grad_h, grad_w, grad_b]
        ctx.has = tuple(g is not None for g in kept)
        ctx.lead, ctx.rows_per_chunk, ctx.prefix = lead, max(1, rows_per_chunk), prefix
        ctx.has_bias = bias is not None
        # the Parameter itself, beside its saved copy: the step is found by identity, and
        # saved-tensor hooks (the user's, an estimate's) may unpack another tensor object
        ctx.stepper, ctx.weight = stepper, weight if stepper is not None else None
        inputs = [flat, weight] + ([bias] if bias is not None else []) if (
            keep is not None and need_grad) else []
        if stepper is not None:  # what the weight's gradient is recomputed from, in rows
            ctx.head = (transforms, smoothing, grad_scale)
            inputs = [flat, weight, target, valid,
                      lse_rows if lse_rows is not None else flat.new_empty(0),
                      # as forward read it: its own step may come before the weight's
                      *([bias.detach().clone()] if bias is not None else [])]
        ctx.save_for_backward(*[g for g in kept if g is not None], *inputs)
        ctx.set_materialize_grads(False)
        if logits is None:
            return loss, None
        return loss, logits.view(*lead, vocab)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor | None, grad_logits: torch.Tensor | None
                 ) -> tuple:
        saved = list(ctx.saved_tensors)
        grads = [saved.pop(0) if has else None for has in ctx.has]
        # the kept gradients are consumed: scaled in place, so no second copy is ever made
        if grad_loss is not None:
            grads = [None if g is None else g.mul_(grad_loss) for g in grads]
        else:
            grads = [None if g is None else g.zero_() for g in grads]
        grad_h, grad_w, grad_b = grads
        if ctx.stepper is not None:
            grad_w = _hand_over_weight_gradient(ctx, saved, grad_loss)
        elif grad_logits is not None and saved:
            flat, weight = saved[0], saved[1]
            bias = saved[2] if ctx.has_bias else None
            rows = flat.shape[0]
            gl = grad_logits.reshape(rows, -1)
            for start in chunk_starts(rows, ctx.rows_per_chunk):
                stop = min(start + ctx.rows_per_chunk, rows)
                h, dz = flat[start:stop], gl[start:stop]
                if ctx.prefix:  # rebuild the chunk's logits to differentiate the transforms
                    z = F.linear(h, weight, bias)
                    _, steps = _forward_transforms(z, ctx.prefix, need_grad=True)
                    dz = _backward_transforms(dz.clone(), steps).to(z.dtype)
                _accumulate(dz, h, weight, None if grad_h is None else grad_h[start:stop],
                            grad_w, grad_b, add=True)
        if grad_h is not None:
            grad_h = grad_h.view(*ctx.lead, grad_h.shape[-1])
        return grad_h, grad_w, grad_b, None, None


def _hand_over_weight_gradient(ctx: Any, saved: list[torch.Tensor],
                               grad_loss: torch.Tensor | None) -> torch.Tensor | None:
    """Backward where forward left the weight's gradient to its fused step: hand the step a
    function computing rows of it (None returned for the weight), or, where that step no longer
    takes it (paused or removed since forward), the gradient whole."""
    flat, weight, target, valid, lse = saved[:5]
    bias = saved[5] if ctx.has_bias else None
    if grad_loss is None:
        return None
    transforms, smoothing, grad_scale = ctx.head
    scale = valid.to(lse.dtype) * grad_loss.to(lse.dtype)
    if grad_scale is not None:
        scale.mul_(grad_scale)

    def rows_of(first: int, last: int) -> torch.Tensor:
        return _weight_gradient_rows(flat, weight, bias, target, scale, lse, first, last,
                                     transforms, smoothing)

    stepper, parameter, ctx.stepper, ctx.weight = ctx.stepper, ctx.weight, None, None
    return hand_over_rows(stepper, parameter, rows_of)


def _weight_gradient_rows(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          target: torch.Tensor, scale: torch.Tensor, lse: torch.Tensor,
                          first: int, last: int, transforms: tuple, smoothing: float
                          ) -> torch.Tensor:
    """Rows ``first:last`` of the loss's gradient for the weight (vocabulary entries),
    recomputed over chunks of tokens from the hidden states, each token's log-sum-exp over the
    whole vocabulary (kept from forward) and its target: ``dz[:, first:last]^T @ hidden``,
    ``dz`` the logits' gradient, scaled per token by ``scale`` (the loss's gradient, the mean's
    divisor, zero where ignored). A chunk's temporaries are tokens x rows (Cut Cross-Entropy's
    way: one more projection of those rows, no vocab x hidden tensor)."""
    tokens, size = flat.shape
    vocab, rows = weight.shape[0], last - first
    part = weight[first:last]
    part_bias = None if bias is None else bias[first:last]
    out = torch.zeros((rows, size), dtype=weight.dtype, device=weight.device)
    budget = max(tokens * size * flat.element_size(), TARGET_CHUNK_BYTES)
    step = max(1, min(tokens, max(MIN_CHUNK_ROWS,
                                  floor_pow2(budget // (rows * lse.element_size())))))
    for start in chunk_starts(tokens, step):
        stop = min(start + step, tokens)
        h, t = flat[start:stop], target[start:stop]
        z = F.linear(h, part, part_bias)
        y, steps = _forward_transforms(z, transforms, need_grad=True)
        grad = y.sub_(lse[start:stop].unsqueeze(1)).exp_()
        here = (t >= first) & (t < last)
        column = (t - first).clamp(0, rows - 1).unsqueeze(1)
        grad.scatter_add_(1, column, here.to(grad.dtype).mul_(smoothing - 1.0).unsqueeze(1))
        if smoothing:
            grad.sub_(smoothing / vocab)
        grad.mul_(scale[start:stop].unsqueeze(1))
        _accumulate(_backward_transforms(grad, steps).to(z.dtype), h, part, None, out, None)
    return out


def _accumulate(dz: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                grad_h: torch.Tensor | None, grad_w: torch.Tensor | None,
                grad_b: torch.Tensor | None, add: bool = False) -> None:
    """Fold one chunk's logit gradient ``dz`` into the gradients for the chunk's hidden rows
    (written, or added with ``add``), the weight and the bias (added, in place)."""
    if grad_h is not None:
        if not add and grad_h.dtype == dz.dtype == weight.dtype:
            torch.mm(dz, weight, out=grad_h)
        elif not add:
            grad_h.copy_(torch.mm(dz, weight.to(dz.dtype)))
        else:
            grad_h.add_(torch.mm(dz, weight.to(dz.dtype)))
    if grad_w is not None:
        if grad_w.dtype == dz.dtype == h.dtype:
            grad_w.addmm_(dz.t(), h)
        else:
            grad_w.add_(torch.mm(dz.t(), h.to(dz.dtype)))
    if grad_b is not None:
        grad_b.add_(dz.sum(dim=0))


def _loss_dtype(flat: torch.Tensor, weight: torch.Tensor, transforms: tuple,
                autocast: bool) -> torch.dtype:
    """The dtype cross_entropy would have returned."""
    dtype = autocast_dtype(flat.device.type) if autocast else torch.result_type(
        flat, weight)
    for transform in transforms:
        if transform[0] == "to":
            dtype = transform[1]
    if autocast and dtype in _LOW_PRECISION:
        dtype = torch.float32
    return dtype
