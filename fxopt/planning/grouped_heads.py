"""Which causal attention calls read keys and values whose heads were repeated for grouped-query
attention: the decisions ``causal_attention`` applies (it hands sdpa the unrepeated tensors
with ``enable_gqa=True``).

Grouped-query attention (Llama 3, Qwen, Mistral, Gemma) has fewer key/value heads than query
heads. Eager Hugging Face, whose causal mask is then None, calls sdpa with ``enable_gqa=True``
on the key/value heads as they are. Traced, it builds the mask as a tensor and repeats each key
and value head for its query heads (``repeat_kv``: ``k[:, :, None].expand(...).reshape(...)``),
so every layer materializes and keeps for backward two copies the eager model never makes: at
32 query and 8 key/value heads, 2 x 4096 tokens, head dim 64 in bfloat16, 64 MiB per layer.
Once ``causal_attention`` has made the call causal with no mask, the model's own eager path is
this one.

``grouped_sources(call)`` returns ``(key, value)``, the tensors before the repetition, when both
of the sdpa call's key and value are provably such a repetition, else None. Provably:

- each is reached from its source through data-movement operators alone (``slice``,
  ``unsqueeze``, ``expand``, ``clone``, ``view``, ``_unsafe_view``, ``reshape``), whose values
  are a fixed selection of the source's, so where every value goes is read off one evaluation;
- evaluated on the CPU on a probe of distinct values (sizes: the example's batch and one more,
  the others as captured, as ``fxopt.planning.causal_mask`` evaluates a mask), the result is
  the probe with each head repeated ``n`` times in place (``repeat_interleave(n, dim=1)``), the
  grouping sdpa's ``enable_gqa`` applies, and ``n`` is the same for key and value;
- key and value have the same head dimension, at most 256 (transformers' condition for CUDA
  kernels that serve grouped heads without falling back to the math kernel).

Decision only: no graph is edited here.
"""

from __future__ import annotations

import math
import torch
from torch import fx

from fxopt.core.torch_private import UNSAFE_VIEW
from fxopt.planning.causal_mask import evaluate_at_batch, sdpa_argument

_aten = torch.ops.aten
_MOVES = frozenset({_aten.slice.Tensor, _aten.unsqueeze.default, _aten.expand.default,
                    _aten.clone.default, _aten.view.default, _aten.reshape.default}) | UNSAFE_VIEW
_SYM_SIZE = _aten.sym_size.int
MAX_HEAD_DIM = 256
_CPU = torch.device("cpu")


def grouped_sources(call: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(key, value) before their heads were repeated, for the sdpa ``call`` (module docstring),
    or None."""
    query, key, value = (sdpa_argument(call, i, name) for i, name in
                         enumerate(("query", "key", "value")))
    if not all(isinstance(t, fx.Node) for t in (query, key, value)):
        return None
    found = [_repeated_source(t) for t in (key, value)]
    if any(f is None for f in found):
        return None
    (k, n_k), (v, n_v) = found
    shapes = [t.meta.get("val") for t in (query, k, v)]
    if n_k != n_v or any(s is None or s.dim() != 4 for s in shapes):
        return None
    q_val, k_val, v_val = shapes
    if q_val.shape[1] != n_k * k_val.shape[1] or k_val.shape[-1] != v_val.shape[-1]:
        return None
    if not isinstance(k_val.shape[-1], int) or k_val.shape[-1] > MAX_HEAD_DIM:
        return None
    return k, v


def _repeated_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(source, n) where ``node`` is ``source`` with each head repeated n > 1 times in place."""
    chain: list[fx.Node] = []
    current = node
    while (current.op == "call_function" and current.target in _MOVES
           and isinstance(current.args[0], fx.Node)):
        chain.append(current)
        current = current.args[0]
    if not chain:
        return None
    source, out = current.meta.get("val"), node.meta.get("val")
    if source is None or out is None or source.dim() != 4 or out.dim() != 4:
        return None
    heads, repeated = source.shape[1], out.shape[1]
    if not isinstance(heads, int) or not isinstance(repeated, int) or repeated <= heads or (
            repeated % heads):
        return None
    n = repeated // heads
    if not all(isinstance(s, int) for s in source.shape):
        return None
    batch = source.shape[0]
    if not all(_repeats(current, chain, n, b) for b in (batch, batch + 1)):
        return None
    return current, n


def _repeats(source: fx.Node, chain: list[fx.Node], n: int, batch: int) -> bool:
    """Whether ``chain`` (output first, back to ``source``) maps a probe of distinct values at
    batch ``batch`` to the probe with each head repeated ``n`` times in place."""
    sizes = [batch, *source.meta["val"].shape[1:]]
    # int32 holds every index exactly (2**31 elements would be 8 GiB of probe), in half the
    # memory float64 took: at 2 x 2048 tokens these probes are most of the pass's time
    probe = torch.arange(math.prod(sizes), dtype=torch.int32, device=_CPU).view(sizes)
    sizes_read = {a for node in chain for a in node.all_input_nodes if a.target is _SYM_SIZE}
    result = evaluate_at_batch(source.graph.owning_module, {*chain, *sizes_read}, chain[0],
                               batch, given={source: probe})
    expected = probe.repeat_interleave(n, dim=1)
    return (isinstance(result, torch.Tensor) and result.shape == expected.shape
            and bool(torch.equal(result, expected)))
