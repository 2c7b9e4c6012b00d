"""A transformer block's MLP whose big intermediate is never held whole: computed over chunks of
tokens in forward, and recomputed chunk by chunk in backward.

``passes.chunked_mlp`` rewrites ``down(act(gate(x)) * up(x))`` (Llama, Qwen, Mistral, Gemma) and
``down(act(up(x)))`` (GPT, BERT, ViT), where every projection is a ``linear`` and the
intermediate is wider than ``x``, into ``chunked_mlp(x, gate_w, gate_b, up_w, up_b, down_w, down_b,
activation, min_rows)``. The MLP acts on each token alone, so rows of ``x`` are independent:

- forward computes the output a chunk of tokens at a time, without grad, and saves only ``x``
  (and the weights): none of the batch x sequence x intermediate tensors the plain MLP saves for
  backward (the two projections, the activation, their product);
- backward recomputes each chunk's two projections and the activation, and folds the chunk's
  gradients straight into ``x``'s gradient (one row block) and the weights' (accumulated in place
  in the weight's own dtype: the matmul sums each chunk's part in float32 and rounds it once,
  so a bfloat16 weight gradient is rounded once per chunk, at most about intermediate / hidden
  times; a float32 sum would hold three weight-sized temporaries of twice the size, on a
  Llama-1B layer about the memory the chunks save).

A chunk holds ``max(min_rows, tokens * hidden / intermediate)`` tokens, so each intermediate
tensor it makes is about the size of ``x``. The cost is one more forward of the two input
projections in backward (two matmuls of the MLP's nine). Exact up to the order of float sums: a
weight's gradient is summed over chunks instead of in one matmul.

Without grad (or when no input requires it), and while ``torch.compile`` traces, the call is
the plain MLP. Under autocast, the recomputation runs under the same autocast settings and the
matmuls in its dtype, as the plain MLP's forward and backward do. A second backward through the
same call (``retain_graph=True``) works; ``create_graph=True`` does not make the gradients
differentiable again (``once_differentiable``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .devices import autocast_dtype

aten = torch.ops.aten
ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def chunked_mlp(x: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor | None,
                up_w: torch.Tensor | None, up_b: torch.Tensor | None, down_w: torch.Tensor,
                down_b: torch.Tensor | None, activation: str, min_rows: int) -> torch.Tensor:
    """``linear(act(linear(x, gate_w, gate_b)) * linear(x, up_w, up_b), down_w, down_b)``
    (without the ``up`` factor when ``up_w`` is None), computed over chunks of tokens (module
    docstring)."""
    tensors = (x, gate_w, gate_b, up_w, up_b, down_w, down_b)
    if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not any(t is not None and t.requires_grad for t in tensors)):
        return _mlp(x, gate_w, gate_b, up_w, up_b, down_w, down_b, activation)
    return _ChunkedMLP.apply(activation, min_rows, *tensors)


def _mlp(x: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor | None,
         up_w: torch.Tensor | None, up_b: torch.Tensor | None, down_w: torch.Tensor,
         down_b: torch.Tensor | None, activation: str) -> torch.Tensor:
    hidden = ACTIVATIONS[activation](F.linear(x, gate_w, gate_b))
    if up_w is not None:
        hidden = hidden * F.linear(x, up_w, up_b)
    return F.linear(hidden, down_w, down_b)


def chunk_rows(tokens: int, width: int, intermediate: int, min_rows: int) -> int:
    """Tokens per chunk: each intermediate tensor about the size of ``x`` (module docstring)."""
    return max(1, min(tokens, max(min_rows, math.ceil(tokens * width / intermediate))))


class _ChunkedMLP(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, activation: str, min_rows: int, x: torch.Tensor,
                *weights: torch.Tensor | None) -> torch.Tensor:
        gate_w, _, up_w, _, down_w, _ = weights
        flat = x.reshape(-1, x.shape[-1])
        rows = chunk_rows(flat.shape[0], flat.shape[1], gate_w.shape[0], min_rows)
        out = None
        for first in range(0, flat.shape[0], rows):
            piece = _mlp(flat[first:first + rows], *weights, activation)
            if out is None:
                out = piece.new_empty((flat.shape[0], piece.shape[-1]))
            out[first:first + rows] = piece
        if out is None:  # no tokens
            out = _mlp(flat, *weights, activation)
        device = x.device.type
        ctx.autocast = autocast_dtype(device)
        ctx.activation, ctx.rows, ctx.device = activation, rows, device
        ctx.present = [w is not None for w in weights]
        ctx.save_for_backward(x, *(w for w in weights if w is not None))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, *present = ctx.saved_tensors
        found = iter(present)
        gate_w, gate_b, up_w, up_b, down_w, down_b = (
            next(found) if here else None for here in ctx.present)
        needs = ctx.needs_input_grad[2:]
        flat = x.reshape(-1, x.shape[-1])
        grad = grad.reshape(-1, grad.shape[-1])
        cast = ctx.autocast or x.dtype
        matmul = [None if w is None else w.to(cast) for w in (gate_w, up_w, down_w)]
        sums = [None if t is None or not need else
                torch.zeros_like(t) for t, need in
                zip((gate_w, gate_b, up_w, up_b, down_w, down_b), needs[1:])]
        x_grad = torch.empty_like(x).reshape(flat.shape) if needs[0] else None
        with (torch.autocast(ctx.device, dtype=ctx.autocast) if ctx.autocast is not None
              else contextlib.nullcontext()):
            for first in range(0, flat.shape[0], ctx.rows):
                rows = slice(first, first + ctx.rows)
                piece = flat[rows].to(cast)
                _backward_rows(piece, grad[rows].to(cast), matmul, (gate_b, up_b),
                               ctx.activation, sums, x_grad, rows)
        return (None, None, None if x_grad is None else x_grad.reshape(x.shape), *sums)


def _backward_rows(x: torch.Tensor, grad: torch.Tensor, matmul: list, biases: tuple,
                   activation: str, sums: list, x_grad: torch.Tensor | None,
                   rows: slice) -> None:
    """One chunk of tokens: recompute its projections and add its part of every gradient.
    Written out rather than through autograd so each temporary is freed as soon as it is read:
    at most five of the chunk's intermediate-wide tensors are alive at once."""
    gate_w, up_w, down_w = matmul
    gate_b, up_b = (None if b is None else b.to(x.dtype) for b in biases)
    gate = F.linear(x, gate_w, gate_b)
    up = None if up_w is None else F.linear(x, up_w, up_b)
    active = ACTIVATIONS[activation](gate)
    hidden = active if up is None else active * up
    _add(sums[4], grad.t(), hidden)
    _add_rows(sums[5], grad)
    del hidden
    hidden_grad = grad @ down_w  # the gradient of act(gate) * up
    up_grad = None
    if up is not None:
        up_grad = hidden_grad * active
        hidden_grad.mul_(up)     # now the gradient of act(gate)
        del up
    del active
    gate_grad = _activation_backward(activation, hidden_grad, gate)
    del hidden_grad, gate
    _add(sums[0], gate_grad.t(), x)
    _add_rows(sums[1], gate_grad)
    if up_grad is not None:
        _add(sums[2], up_grad.t(), x)
        _add_rows(sums[3], up_grad)
    if x_grad is not None:
        part = gate_grad @ gate_w
        if up_grad is not None:
            part.addmm_(up_grad, up_w)
        x_grad[rows] = part


def _activation_backward(activation: str, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``ACTIVATIONS[activation]`` at ``x``, by torch's own backward kernels."""
    if activation == "silu":
        return aten.silu_backward(grad, x)
    if activation == "relu":
        return aten.threshold_backward(grad, x, 0)
    return aten.gelu_backward(grad, x, approximate="tanh" if activation == "gelu_tanh"
                              else "none")


def _add(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> None:
    if total is None:
        return
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += (a @ b).to(total.dtype)


def _add_rows(total: torch.Tensor | None, grad: torch.Tensor) -> None:
    if total is not None:
        total += grad.sum(0, dtype=total.dtype)
