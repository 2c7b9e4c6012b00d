"""Scaled dot-product attention with a built causal mask -> ``is_causal=True``, no mask (and
grouped key/value heads unrepeated, ``enable_gqa=True``).

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

Grouped-query attention: a call left with no mask whose keys and values are provably their
heads repeated for the query heads (``repeat_kv``, as traced Hugging Face models do once they
have a mask tensor) reads the unrepeated tensors with ``enable_gqa=True`` instead, as the eager
model does without a mask, and the two copies per layer it held for backward are gone
(``fxopt.planning.grouped_heads`` says when).

Which calls qualify is decided by ``fxopt.planning.causal_mask`` and
``fxopt.planning.grouped_heads``; this pass edits them.
Verification then checks outputs and gradients as for every pass. Not handled: masks that also
encode padding (they are not the causal pattern and stay), masks read from inputs, sliding
windows, and module-level (symbolic-tracing) graphs, whose ``F.scaled_dot_product_attention``
calls this pass leaves alone.
"""

from __future__ import annotations

from torch import fx

from fxopt.planning.causal_mask import SDPA, causal_sdpa_calls, sdpa_argument
from fxopt.planning.grouped_heads import grouped_sources
from fxopt.rewrite.pass_base import PassResult, graph_edited, mark_new

__all__ = ["PASS_NAME", "SDPA", "causal_attention"]

PASS_NAME = "causal_attention"


def causal_attention(gm: fx.GraphModule) -> PassResult:
    """Give provably causal masked sdpa calls ``is_causal=True`` and no mask (module docstring)."""
    rewritten: list[str] = []
    skipped: dict[str, str] = {}
    for node, why_not in causal_sdpa_calls(gm).items():  # decided by fxopt.planning.causal_mask
        if why_not:
            skipped[node.name] = why_not
            continue
        args = list(node.args) + [None] * (6 - len(node.args))
        args[3], args[5] = None, True
        args[4] = sdpa_argument(node, 4, "dropout_p") or 0.0
        kwargs = {k: v for k, v in node.kwargs.items()
                  if k not in ("attn_mask", "dropout_p", "is_causal")}
        node.args, node.kwargs = tuple(args[:6]), kwargs
        mark_new(node, PASS_NAME)
        rewritten.append(node.name)
    grouped = _ungroup(gm)
    if rewritten or grouped:
        gm.graph.eliminate_dead_code()
        graph_edited(gm)
    return PassResult(gm, bool(rewritten or grouped),
                      {"rewritten": len(rewritten), "sites": rewritten,
                       "grouped": grouped, "skipped": skipped})


def _ungroup(gm: fx.GraphModule) -> list[str]:
    """Unmasked sdpa calls on repeated key/value heads read them unrepeated, with
    ``enable_gqa=True`` (module docstring); the calls edited."""
    edited = []
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        if (len(node.args) < 3 or sdpa_argument(node, 3, "attn_mask") is not None
                or node.kwargs.get("enable_gqa")):
            continue
        sources = grouped_sources(node)
        if sources is None:
            continue
        node.args = (node.args[0], *sources, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        mark_new(node, PASS_NAME)
        edited.append(node.name)
    return edited
