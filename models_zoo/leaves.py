"""Models with a data-dependent submodule that fxopt keeps as an opaque leaf (issue 25).

- ``BranchyCNN``: conv-BN-ReLU stem, a ``ValueBranch`` block whose forward does
  ``if x.mean() > 0:`` (symbolic tracing cannot follow it, so it falls back to a leaf), four
  more conv-BN-ReLU stages, average pool, Linear head. Input ``(B, 3, 32, 32)``.
- ``MoETransformer``: a 2-layer pre-LN transformer (the zoo's hand-written attention) whose
  feed-forward is a top-1 mixture of experts that dispatches tokens with ``torch.where`` and
  ``index_add_``. Symbolic tracing follows that code, but its output shapes depend on the
  routing (``aten.nonzero``), so it cannot run on fake tensors: give its blocks' ``moe`` as
  ``leaf_modules=("blocks.0.moe", "blocks.1.moe")`` (``MOE_LEAVES``). Input float ``(B, 64, 64)``.
- ``olmoe_eager_experts``: transformers' OLMoE with its eager expert loop, whose root only
  torch.export captures: fxopt keeps the experts as opaque calls (issue 25, item 3).

Neither of the first two draws random numbers in forward before its data-dependent part (no
dropout there), so the routing, and with it the memory a step takes, is the same on every run
for the same inputs. Not registered in ``models_zoo.names()`` (whose models all run on fake
tensors as they are); build them with the factories below, which return ``(model,
example_inputs)`` like a CLI factory target (``fxopt.models_zoo.leaves:branchy_cnn``).
"""

from __future__ import annotations

import torch
from torch import nn

from fxopt.models_zoo.entry import float_inputs, seeded_builder
from fxopt.models_zoo.transformer import SelfAttention


def _conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, stride=stride),
                         nn.BatchNorm2d(c_out), nn.ReLU())


class ValueBranch(nn.Module):
    """Branches on a value: one conv path when the mean activation is positive, another if not."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.positive = nn.Conv2d(channels, channels, 3, padding=1)
        self.negative = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return torch.relu(self.positive(x)) + x
        return torch.tanh(self.negative(x)) * x


class BranchyCNN(nn.Module):
    """Stem, a value-branching block, two conv-BN-ReLU stages, pooling and a Linear head."""

    def __init__(self, channels: int = 16, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = _conv_bn_relu(3, channels)
        self.branch = ValueBranch(channels)
        self.stages = nn.Sequential(*(_conv_bn_relu(channels, channels) for _ in range(depth)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.branch(self.stem(x)))
        return self.head(x.mean((2, 3)))


class TopOneMoE(nn.Module):
    """Top-1 mixture of experts: each token goes to the expert its router scores highest, scaled
    by that score; tokens are gathered with ``torch.where`` and scattered back with
    ``index_add_``."""

    def __init__(self, dim: int, experts: int = 4, hidden: int = 256) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, -2)
        weight, choice = torch.softmax(self.router(tokens), dim=-1).max(dim=-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            picked = torch.where(choice == index)[0]
            out.index_add_(0, picked, expert(tokens[picked]) * weight[picked].unsqueeze(-1))
        return out.view_as(x)


class MoEBlock(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then x + moe(ln2(x)); no dropout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.attn.attn_dropout.p = 0.0
        self.ln2 = nn.LayerNorm(dim)
        self.moe = TopOneMoE(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoETransformer(nn.Module):
    """Input projection, two MoE blocks, a final LayerNorm and a Linear head."""

    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*(MoEBlock(dim, heads) for _ in range(depth)))
        self.ln_final = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_final(self.blocks(self.proj(x))))


MOE_LEAVES = ("blocks.0.moe", "blocks.1.moe")
BRANCHY_BATCH = 4
MOE_BATCH = 8


def branchy_cnn(batch_size: int = BRANCHY_BATCH) -> tuple[nn.Module, tuple]:
    """A deterministic ``BranchyCNN`` in train mode and its example inputs (B, 3, 32, 32)."""
    return seeded_builder(BranchyCNN)(), float_inputs(3, 32, 32)(batch_size)


def moe_transformer(batch_size: int = MOE_BATCH) -> tuple[nn.Module, tuple]:
    """A deterministic ``MoETransformer`` in train mode and its example inputs (B, 64, 64);
    optimize it with ``leaf_modules=MOE_LEAVES``."""
    return seeded_builder(MoETransformer)(), float_inputs(64, 64)(batch_size)


OLMOE_SEQ = 16


def olmoe_eager_experts(batch_size: int = 2) -> tuple[nn.Module, dict]:
    """A tiny random OLMoE causal LM (transformers' ``OlmoeForCausalLM``: 2 layers, 4 experts,
    top-2) whose experts run transformers' eager loop over the experts hit (``nonzero`` and
    ``torch.where``: torch.export cannot follow it), and its keyword inputs
    ``{"input_ids", "labels"}`` (B, 16). Needs transformers (the ``test`` extra)."""
    import transformers

    def build() -> nn.Module:
        config = transformers.OlmoeConfig(
            vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, use_cache=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
        config._experts_implementation = "eager"  # not grouped_mm: the Python expert loop
        return transformers.OlmoeForCausalLM(config)

    ids = torch.randint(0, 1000, (batch_size, OLMOE_SEQ),
                        generator=torch.Generator().manual_seed(0))
    return seeded_builder(build)(), {"input_ids": ids, "labels": ids}
