"""A pre-LN transformer block written out with plain modules, and a small language model of two.

Attention is spelled out (Linear q/k/v/out, matmul, softmax, dropout, matmul) rather than calling
``F.scaled_dot_product_attention`` or ``nn.MultiheadAttention``, so every intermediate is a graph
node that memory passes can see. Head splitting uses ``unflatten``/``flatten`` so no shape value
is read at trace time; any batch size and sequence length up to ``max_seq_len`` (causal mask)
works.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fxopt.models_zoo.entry import ZooEntry, float_inputs, token_inputs, zoo_entry

DROPOUT = 0.1
GPT2_VOCAB = 50257


class SelfAttention(nn.Module):
    """Multi-head self attention; with ``causal`` each position attends only to earlier ones."""

    def __init__(self, dim: int, heads: int, *, causal: bool = False,
                 max_seq_len: int = 1024) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.causal = causal
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(DROPOUT)
        if causal:
            future = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).triu(1)
            self.register_buffer("future_mask", future, persistent=False)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if self.causal:
            seq_len = x.size(1)
            # narrow, not slicing: a buffer is a real tensor during tracing and rejects proxy slices
            future = self.future_mask.narrow(0, 0, seq_len).narrow(1, 0, seq_len)
            scores = scores.masked_fill(future, float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        mixed = torch.matmul(weights, v).transpose(1, 2).flatten(2)
        return self.out_proj(mixed)


class TransformerBlock(nn.Module):
    """Pre-LN block: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))) with a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int, *, causal: bool = False,
                 max_seq_len: int = 1024) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal=causal, max_seq_len=max_seq_len)
        self.attn_residual_dropout = nn.Dropout(DROPOUT)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.mlp_residual_dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_residual_dropout(self.attn(self.ln1(x)))
        return x + self.mlp_residual_dropout(self.mlp(self.ln2(x)))


class TinyLanguageModel(nn.Module):
    """Token + learned position embeddings, causal blocks, final LayerNorm and an untied LM head."""

    def __init__(self, vocab_size: int = GPT2_VOCAB, dim: int = 100, heads: int = 5, depth: int = 2,
                 max_seq_len: int = 256) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Parameter(torch.randn(max_seq_len, dim) * 0.02)
        self.embedding_dropout = nn.Dropout(DROPOUT)
        self.blocks = nn.Sequential(*(
            TransformerBlock(dim, heads, causal=True, max_seq_len=max_seq_len) for _ in range(depth)
        ))
        self.ln_final = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.size(1)
        x = self.token_embedding(tokens) + self.position_embedding[:seq_len]
        x = self.blocks(self.embedding_dropout(x))
        return self.lm_head(self.ln_final(x))


def transformer_block() -> TransformerBlock:
    return TransformerBlock(64, 4)


ENTRIES: tuple[ZooEntry, ...] = (
    zoo_entry("transformer_block", transformer_block, float_inputs(32, 64), default_batch=4,
              description="one pre-LN transformer block, dim 64, 4 heads, hand-written attention, "
                          "GELU MLP; input (B,32,64)",
              tags=("transformer", "dropout", "layernorm", "attention")),
    zoo_entry("transformer_lm", TinyLanguageModel, token_inputs(16, GPT2_VOCAB), default_batch=2,
              description="causal LM: Embedding(50257,100), 2 pre-LN blocks (5 heads), LayerNorm, "
                          "Linear(100,50257) head; input int64 tokens (B,16) (at most 256 long) "
                          "-> logits (B,16,50257)",
              tags=("transformer", "dropout", "layernorm", "attention", "embedding",
                    "language_model")),
)
