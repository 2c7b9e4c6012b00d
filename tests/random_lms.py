"""Random small causal language models for the fuzz (tests/test_fuzz.py), in the spellings the
language-model passes read: ``causal_attention`` (a causal mask built three ways, or
``is_causal=True``), ``chunked_mlp`` (gated or plain MLPs with SiLU, ReLU or GELU) and
``chunked_loss`` (``F.cross_entropy`` or ``nll_loss`` of ``log_softmax`` over a linear head or
tied embeddings, a soft-cap, shifted labels, ignored tokens), with norms, residuals and dropout
between them.

``lm_specs()`` draws an ``LMSpec``; ``build_lm(spec)`` returns the model (random-init from the
spec's seed) and its example inputs ``(ids, labels)``. A quarter of the models build their mask
from the input's sizes, which only torch.export captures; the rest are captured by symbolic
tracing, which is faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

MASKS = ("is_causal", "bool_tril", "float_triu", "arange")
MLPS = ("gated", "plain", "none")
ACTIVATIONS = ("silu", "relu", "gelu", "gelu_tanh")
LOSSES = ("cross_entropy", "nll", "softcap", "smoothing")


@dataclass(frozen=True)
class LMSpec:
    vocab: int
    width: int
    heads: int
    layers: int
    batch: int
    seq: int
    mask: str
    mask_from_input: bool  # sizes read from the input: symbolic tracing cannot, torch.export can
    mlp: str
    activation: str
    widen: int
    norm: bool
    dropout: float
    tied: bool
    loss: str
    shift: bool
    returns_logits: bool
    ignored: int
    seed: int


@st.composite
def lm_specs(draw) -> LMSpec:
    heads = draw(st.sampled_from([1, 2]))
    return LMSpec(
        vocab=draw(st.integers(5, 40)), width=heads * draw(st.sampled_from([2, 4, 8])),
        heads=heads, layers=draw(st.integers(1, 3)), batch=draw(st.integers(1, 3)),
        seq=draw(st.integers(2, 9)), mask=draw(st.sampled_from(MASKS)),
        mask_from_input=draw(st.sampled_from([False, False, False, True])),
        mlp=draw(st.sampled_from(MLPS)), activation=draw(st.sampled_from(ACTIVATIONS)),
        widen=draw(st.sampled_from([2, 4])), norm=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.3])), tied=draw(st.booleans()),
        loss=draw(st.sampled_from(LOSSES)), shift=draw(st.booleans()),
        returns_logits=draw(st.booleans()), ignored=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)))


def _mask(kind: str, t: int, x: torch.Tensor) -> torch.Tensor | None:
    if kind == "bool_tril":
        return torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    if kind == "float_triu":
        upper = torch.ones(t, t, device=x.device).triu(1).bool()
        return torch.zeros(t, t, device=x.device).masked_fill(upper, float("-inf"))
    if kind == "arange":  # transformers' shape: (batch, 1, T, T)
        rows = torch.arange(t, device=x.device)
        return (rows[None, :] <= rows[:, None])[None, None].expand(x.shape[0], 1, t, t)
    return None


class _Block(nn.Module):
    def __init__(self, spec: LMSpec):
        super().__init__()
        self.spec = spec
        w = spec.width
        self.norm1 = nn.LayerNorm(w) if spec.norm else nn.Identity()
        self.qkv = nn.Linear(w, 3 * w)
        self.proj = nn.Linear(w, w)
        self.norm2 = nn.LayerNorm(w) if spec.norm else nn.Identity()
        inner = w * spec.widen
        self.up = nn.Linear(w, inner)
        self.gate = nn.Linear(w, inner, bias=False) if spec.mlp == "gated" else None
        self.down = nn.Linear(inner, w)
        self.drop = nn.Dropout(spec.dropout)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.spec.activation
        if kind == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        return {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}[kind](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        h = self.spec.heads
        q, k, v = self.qkv(self.norm1(x)).split(w, dim=-1)
        q, k, v = (z.view(b, t, h, w // h).transpose(1, 2) for z in (q, k, v))
        mask = _mask(self.spec.mask, t if self.spec.mask_from_input else self.spec.seq, x)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           is_causal=self.spec.mask == "is_causal")
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, w)))
        if self.spec.mlp == "none":
            return x
        y = self.norm2(x)
        if self.gate is not None:
            inner = self._act(self.gate(y)) * self.up(y)
        else:
            inner = self._act(self.up(y))
        return x + self.down(inner)


class RandomLM(nn.Module):
    def __init__(self, spec: LMSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.width)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.layers))
        self.head = None if spec.tied else nn.Linear(spec.width, spec.vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = x @ self.embed.weight.T if self.head is None else self.head(x)
        v = self.spec.vocab
        if self.spec.loss == "softcap":
            logits = torch.tanh(logits / 3.0) * 3.0
        scored, targets = logits, labels
        if self.spec.shift:
            scored, targets = logits[:, :-1], labels[:, 1:]
        scored, targets = scored.reshape(-1, v), targets.reshape(-1)
        if self.spec.loss == "nll":
            loss = F.nll_loss(F.log_softmax(scored.float(), dim=-1), targets)
        elif self.spec.loss == "smoothing":
            loss = F.cross_entropy(scored, targets, label_smoothing=0.1)
        else:
            loss = F.cross_entropy(scored, targets)
        return {"loss": loss, "logits": logits} if self.spec.returns_logits else {"loss": loss}


def build_lm(spec: LMSpec) -> tuple[RandomLM, tuple[torch.Tensor, torch.Tensor]]:
    """The model and ``(ids, labels)``; at most ``spec.ignored`` labels are -100, never a row's
    last, which is scored with or without the shift."""
    torch.manual_seed(spec.seed)
    model = RandomLM(spec)
    gen = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=gen)
    labels = ids.clone()
    flat = labels.view(-1)
    for i in torch.randperm(flat.numel(), generator=gen)[:spec.ignored].tolist():
        if i % spec.seq != spec.seq - 1:
            flat[i] = -100
    return model, (ids, labels)
