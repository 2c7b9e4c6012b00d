"""An embedding lookup whose weight gradient goes to a fused optimizer step in rows.

``passes.embedding_rows`` rewrites ``torch.embedding(weight, indices, ...)`` (``aten.embedding``,
``F.embedding``, an ``nn.Embedding`` call) into ``embedding_rows(weight, indices, padding_idx)``.
Forward is torch's lookup. Backward, where a fused optimizer step takes ``weight``'s gradient in
rows (``fxopt.runtime.fused_step.rows_stepper``, decided in forward), does not make the
vocab x hidden gradient torch's backward makes: it hands the step a function that computes one
block of rows from the lookups that hit it (torch's own ``embedding_dense_backward``, the others sent to a
row past the block and dropped), and returns no gradient for ``weight``. Otherwise (no fused step, or
paused: fxopt's own runs) the gradient is torch's, made whole.

Not handled: ``scale_grad_by_freq``, ``sparse`` and ``max_norm`` lookups (the pass leaves them).
Imports torch and ``fxopt.runtime`` only: an exported folder copies it.
"""

from __future__ import annotations

from typing import Any

import torch

from .fused_step import hand_over_rows, rows_stepper


def embedding_rows(weight: torch.Tensor, indices: torch.Tensor,
                   padding_idx: int = -1) -> torch.Tensor:
    """``torch.embedding(weight, indices, padding_idx)``; its gradient for ``weight`` handed to
    a fused step in rows where one takes it (module docstring)."""
    stepper = (rows_stepper(weight) if torch.is_grad_enabled() and weight.requires_grad
               else None)
    if stepper is None:
        return torch.embedding(weight, indices, padding_idx)
    return _EmbeddingRows.apply(weight, indices, padding_idx, stepper)


class _EmbeddingRows(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int,
                stepper: Any) -> torch.Tensor:
        ctx.save_for_backward(indices)
        # the Parameter itself, not a saved tensor: its step may come before this backward's
        # end is unpacked, and only its shape and identity are read
        ctx.weight, ctx.padding_idx, ctx.stepper = weight, padding_idx, stepper
        return torch.embedding(weight, indices, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (indices,) = ctx.saved_tensors
        weight, stepper, padding_idx = ctx.weight, ctx.stepper, ctx.padding_idx
        ctx.weight = ctx.stepper = None
        flat = indices.reshape(-1)
        grad = grad.reshape(flat.numel(), -1)

        def rows_of(first: int, last: int) -> torch.Tensor:
            # lookups outside the block go to one row past it, dropped (no data-dependent
            # shapes: the fake-tensor estimate runs this too)
            local = torch.where((flat >= first) & (flat < last), flat - first, last - first)
            padding = padding_idx - first if first <= padding_idx < last else -1
            return torch.ops.aten.embedding_dense_backward(
                grad, local, last - first + 1, padding, False)[:last - first]

        return hand_over_rows(stepper, weight, rows_of), None, None, None
