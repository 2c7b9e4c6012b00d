"""Scaled dot-product attention with a built causal mask -> ``is_causal=True``, no mask.

Traced by torch.export, Hugging Face models build their causal mask as a tensor (transformers
skips it, and asks sdpa for ``is_causal=True``, only when it is not being traced): a bool or
float ``(batch, 1, T, T)`` tensor computed from ``arange`` and the input's batch size, handed to
every layer's ``aten.scaled_dot_product_attention``. That mask is kept for backward (in float32:
1 MiB per layer input at batch 4, T=256), every checkpointed region keeps it as an input, and a
masked sdpa runs slower than a causal one. This pass gives sdpa ``is_causal=True`` and no mask
where the mask is provably the causal one, and removes the mask's computation when nothing else
reads it.

Safe when (all checked; otherwise the call is left as it is, with the reason in the stats):

- the mask is computed from shapes and constants only: its computation reads no graph input
  but through ``aten.sym_size`` (the dynamic batch size), no parameter or buffer, and draws no
  random numbers;
- evaluated at the example's batch size and one more (its only free size: the others are fixed
  by the capture and its input guard), it is the causal pattern for the call's query and key
  lengths, which are equal (``is_causal`` aligns the triangle at the top left): ``True`` (bool)
  or ``0.0`` (float) on and below the diagonal, ``False`` or ``-inf`` (or the dtype's lowest
  value, as transformers writes it) above;
- the call is the ATen overload ``aten.scaled_dot_product_attention.default``, not already causal.

Verification then checks outputs and gradients as for every pass. Not handled: masks that also
encode padding (they are not the causal pattern and stay), masks read from inputs, sliding
windows, and module-level (symbolic-tracing) graphs, whose ``F.scaled_dot_product_attention``
calls this pass leaves alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fxopt.analysis.randomness import draws_random_numbers
from fxopt.analysis.reach import ancestors
from fxopt.capture.meta import refresh_meta
from fxopt.rewrite.pass_base import PassResult, mark_new

PASS_NAME = "causal_attention"
SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SYM_SIZE = torch.ops.aten.sym_size.int


def causal_attention(gm: fx.GraphModule) -> PassResult:
    """Give provably causal masked sdpa calls ``is_causal=True`` and no mask (module docstring)."""
    rewritten: list[str] = []
    skipped: dict[str, str] = {}
    verdicts: dict[fx.Node, str | None] = {}  # mask node -> why it is not causal, or None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask, causal = _argument(node, 3, "attn_mask"), _argument(node, 5, "is_causal")
        if not isinstance(mask, fx.Node) or causal:
            continue
        if mask not in verdicts:
            verdicts[mask] = _why_not_causal(gm, mask, node)
        why_not = verdicts[mask] or _lengths_differ(node)
        if why_not:
            skipped[node.name] = why_not
            continue
        args = list(node.args) + [None] * (6 - len(node.args))
        args[3], args[5] = None, True
        args[4] = _argument(node, 4, "dropout_p") or 0.0
        kwargs = {k: v for k, v in node.kwargs.items()
                  if k not in ("attn_mask", "dropout_p", "is_causal")}
        node.args, node.kwargs = tuple(args[:6]), kwargs
        mark_new(node, PASS_NAME)
        rewritten.append(node.name)
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        refresh_meta(gm)
    return PassResult(gm, bool(rewritten), {"rewritten": len(rewritten), "sites": rewritten,
                                             "skipped": skipped})


def _argument(node: fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _lengths_differ(node: fx.Node) -> str | None:
    query, key = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
    if query is None or key is None:
        return "the query and key shapes are unknown"
    if query.shape[-2] != key.shape[-2]:
        return "query and key lengths differ: is_causal would align the triangle elsewhere"
    return None


def _why_not_causal(gm: fx.GraphModule, mask: fx.Node, user: fx.Node) -> str | None:
    nodes = ancestors(mask)
    for node in nodes:
        if node.op == "placeholder":
            if any(u.target is not _SYM_SIZE for u in node.users if u in nodes):
                return "the mask reads an input's values"
        elif node.op == "get_attr":
            if node.target in dict(gm.named_parameters()) or node.target in dict(
                    gm.named_buffers()):
                return "the mask reads a parameter or buffer"
        elif node.op != "call_function":
            return f"the mask is computed by a {node.op}"
        elif draws_random_numbers(gm, node):
            return "the mask draws random numbers"
    query = user.args[0].meta.get("val") if isinstance(user.args[0], fx.Node) else None
    if query is None:
        return "the query shape is unknown"
    batch = query.shape[0]
    batches = [batch] if not isinstance(batch, int) else [batch, batch + 1]
    if not all(isinstance(b, int) for b in batches):
        return "the batch size is symbolic with no example value"
    for b in batches:
        value = _evaluate(gm, nodes, mask, b)
        if value is None:
            return "the mask could not be evaluated from shapes alone"
        if not _is_causal_pattern(value, query.shape[-2]):
            return "the mask is not the causal pattern (padding, a window, or another shape)"
    return None


def _evaluate(gm: fx.GraphModule, nodes: set[fx.Node], mask: fx.Node, batch: int
              ) -> torch.Tensor | None:
    """The mask's value with every ``sym_size`` of dimension 0 read as ``batch`` and the other
    sizes as captured."""
    env: dict[fx.Node, Any] = {}
    try:
        for node in gm.graph.nodes:
            if node not in nodes or node.op == "placeholder":
                continue
            if node.op == "get_attr":
                env[node] = getattr(gm, node.target)
            elif node.target is _SYM_SIZE:
                source, dim = node.args
                env[node] = batch if dim == 0 else int(source.meta["val"].shape[dim])
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                env[node] = node.target(*args, **kwargs)
            if node is mask:
                return env[node]
    except Exception:  # a shape that is not an int, an op that needs values: not provable here
        return None
    return None


def _is_causal_pattern(mask: torch.Tensor, length: int) -> bool:
    if mask.dim() < 2 or mask.shape[-2:] != (length, length):
        return False
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, allowed.expand_as(mask)))
    if not mask.is_floating_point():
        return False
    lowest = torch.finfo(mask.dtype).min
    blocked = (mask == float("-inf")) | (mask == lowest)
    return bool(torch.equal(mask == 0, allowed.expand_as(mask))
                and torch.equal(blocked, ~allowed.expand_as(mask)))
