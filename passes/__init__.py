"""fxopt's passes, one file each, and ``REGISTRY``: the built-in pipeline in canonical order.

Each pass is a graph edit only: it asks ``fxopt.planning`` for its decision and applies it.
``keep_blocks``, the structural step that runs last in every pipeline, lives with the pass
machinery (``fxopt.rewrite.blocks``), beside ``fxopt.blocks`` which reads its result.
"""

from __future__ import annotations

from fxopt.rewrite.blocks import keep_blocks
from fxopt.rewrite.registry import PassRegistry, PassSpec
from fxopt.passes.causal_attention import causal_attention
from fxopt.passes.checkpoint import checkpoint
from fxopt.passes.chunked_loss import chunked_loss
from fxopt.passes.chunked_mlp import chunked_mlp
from fxopt.passes.embedding_rows import embedding_rows
from fxopt.passes.inplace_activations import inplace_activations
from fxopt.passes.pad_channels import pad_channels
from fxopt.passes.reorder import reorder

REGISTRY = PassRegistry([
    PassSpec("pad_channels", pad_channels,
             "pad channel/feature sizes to multiples of 8 where aligned kernels are faster "
             "(CUDA half/bfloat16/TF32; force=true elsewhere)", aliases=("pad",)),
    PassSpec("inplace_activations", inplace_activations,
             "make activations in-place where autograd does not need the input",
             aliases=("inplace",)),
    PassSpec("causal_attention", causal_attention,
             "attention given a built causal mask runs as is_causal=True, without the mask, and "
             "on grouped key/value heads unrepeated (enable_gqa), as eager transformers run it "
             "(torch.export-captured transformers)", aliases=("causal",)),
    PassSpec("chunked_loss", chunked_loss,
             "a language model's head and cross-entropy computed over chunks of tokens: the "
             "batch x sequence x vocab tensors of the loss are never held "
             "(outputs='loss': logits the model only returns are not built)",
             default=False, aliases=("chunked",), budget="joins", reads_training=True),
    PassSpec("embedding_rows", embedding_rows,
             "with the optimizer step fused into backward, an embedding's gradient is stepped "
             "a block of rows at a time, never made dense (vocab x hidden)",
             aliases=("embedding",), reads_training=True),
    PassSpec("chunked_mlp", chunked_mlp,
             "a transformer block's MLP computed over chunks of tokens and recomputed in "
             "backward: its wide intermediate is never saved (memory_budget='min')",
             default=False, aliases=("mlp",), budget="joins"),
    PassSpec("checkpoint", checkpoint,
             "recompute the cheapest regions in backward to fit a memory budget, and size "
             "the chunked loss's chunks with the plan",
             default=False, aliases=("ckpt",), budget="keeps", reads_training=True),
    PassSpec("reorder", reorder, "memory-aware topological order (lowest predicted peak)",
             reads_training=True),
    PassSpec("keep_blocks", keep_blocks,
             "the model's repeated blocks stay called submodules (per-block FSDP2, "
             "torch.compile, hooks); runs in every pipeline", always=True, aliases=("blocks",)),
])

__all__ = ["REGISTRY", "PassRegistry", "PassSpec", "causal_attention", "checkpoint",
           "chunked_loss", "chunked_mlp", "embedding_rows", "inplace_activations",
           "keep_blocks", "pad_channels", "reorder"]
