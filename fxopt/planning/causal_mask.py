"""Which masked attention calls are provably causal: the decisions ``causal_attention`` applies
(it rewrites each call this module clears into ``is_causal=True`` with no mask).

``causal_sdpa_calls(gm)`` maps every ``aten.scaled_dot_product_attention.default`` call of
``gm`` that has a mask and is not causal yet to None (its mask is the causal one: rewrite it) or
the reason it stays. A mask is causal when (see the pass's docstring for users):

- it is computed from shapes and constants only: its computation reads no graph input but
  through ``aten.sym_size`` (the dynamic batch size), no parameter or buffer, and draws no random
  numbers;
- evaluated at the example's batch size and one more (its only free size), it is the causal
  pattern for the call's query and key lengths, which are equal: ``True`` (bool) or ``0.0``
  (float) on and below the diagonal, ``False`` or ``-inf`` (or the dtype's lowest value) above.

Evaluating the mask runs its nodes on real tensors on the CPU, whatever device the graph was
captured on (a mask depends on shapes alone, and a ``(B, 1, T, T)`` mask on the GPU would cost
device memory during planning); nothing in ``gm`` is changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fxopt.analysis.randomness import draws_random_numbers
from fxopt.analysis.reach import ancestors
from fxopt.runtime.devices import tensor_device

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SYM_SIZE = torch.ops.aten.sym_size.int


def causal_sdpa_calls(gm: fx.GraphModule) -> dict[fx.Node, str | None]:
    """Each masked, not yet causal sdpa call -> None when its mask is provably causal, else
    why not (each mask is judged once, however many calls read it)."""
    decisions: dict[fx.Node, str | None] = {}
    verdicts: dict[fx.Node, str | None] = {}  # mask node -> why it is not causal, or None
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask, causal = sdpa_argument(node, 3, "attn_mask"), sdpa_argument(node, 5, "is_causal")
        if not isinstance(mask, fx.Node) or causal:
            continue
        if mask not in verdicts:
            verdicts[mask] = _why_not_causal(gm, mask, node)
        decisions[node] = verdicts[mask] or _lengths_differ(node)
    return decisions


def sdpa_argument(node: fx.Node, index: int, name: str) -> Any:
    """The sdpa argument at ``index`` or passed by keyword ``name``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _lengths_differ(node: fx.Node) -> str | None:
    query, key = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
    if query is None or key is None:
        return "the query and key shapes are unknown"
    if query.shape[-2] != key.shape[-2]:
        return "query and key lengths differ: is_causal would align the triangle elsewhere"
    return None


def _why_not_causal(gm: fx.GraphModule, mask: fx.Node, user: fx.Node) -> str | None:
    # a device read (fxopt.runtime.devices) reads no values: the CPU stands for it below
    nodes = ancestors(mask, stop=lambda n: n.target is tensor_device)
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
        value = evaluate_at_batch(gm, nodes, mask, b)
        if value is None:
            return "the mask could not be evaluated from shapes alone"
        if not _is_causal_pattern(value, query.shape[-2]):
            return "the mask is not the causal pattern (padding, a window, or another shape)"
    return None


_CPU = torch.device("cpu")


def evaluate_at_batch(gm: fx.GraphModule, nodes: set[fx.Node], wanted: fx.Node, batch: int,
                      given: dict[fx.Node, Any] | None = None) -> Any:
    """``wanted``'s value on the CPU, running ``nodes`` in graph order from the values
    ``given``, with every ``sym_size`` of dimension 0 read as ``batch`` and the other sizes as
    captured (a ``device=`` the capture baked into a factory op is read as the CPU, and
    constants are copied there); None when that cannot be computed from shapes alone."""
    env: dict[fx.Node, Any] = dict(given or {})
    try:
        for node in gm.graph.nodes:
            if node not in nodes or node.op == "placeholder" or node in env:
                continue
            if node.op == "get_attr":
                value = getattr(gm, node.target)
                env[node] = value.to(_CPU) if isinstance(value, torch.Tensor) else value
            elif node.target is tensor_device:
                env[node] = _CPU
            elif node.target is _SYM_SIZE:
                source, dim = node.args
                env[node] = batch if dim == 0 else int(source.meta["val"].shape[dim])
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                if "device" in kwargs:
                    kwargs = {**kwargs, "device": _CPU}
                env[node] = node.target(*args, **kwargs)
            if node is wanted:
                return env[node]
    # a shape that is not an int, an op that needs values: not provable here
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, NotImplementedError):
        return None
    return None


def _is_causal_pattern(mask: torch.Tensor, length: int) -> bool:
    if mask.dim() < 2 or mask.shape[-2:] != (length, length):
        return False
    allowed = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, allowed.expand_as(mask)))
    if not mask.is_floating_point():
        return False
    lowest = torch.finfo(mask.dtype).min
    blocked = (mask == float("-inf")) | (mask == lowest)
    return bool(torch.equal(mask == 0, allowed.expand_as(mask))
                and torch.equal(blocked, ~allowed.expand_as(mask)))
