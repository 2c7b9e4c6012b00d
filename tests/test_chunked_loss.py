"""passes/chunked_loss.py: a language model's head and cross-entropy over chunks of tokens.

The runtime against ``F.cross_entropy`` in float64 (every option, gradients through the loss and
the returned logits, ignored tokens, a chunk of ignored tokens only, a chunk size that does not
divide the tokens), the pass on both capture paths (goldens, verification, measured memory), its
refusals, and tiny Hugging Face Llama (faithful) and GPT-2 (tied embeddings, loss only).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxopt
from fxopt import passes
from fxopt.capture.chain import capture
from fxopt.core.inputs import bind_keywords
from fxopt.core.step import training_step
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.measure.peaks import measure_train_step
from fxopt.planning.loss_chunks import MIN_CHUNK_ROWS, auto_chunk_rows, decide
from fxopt.runtime.chunked_loss import (
    LogitsNotComputed,
    chunked_loss as chunked_loss_call,
    chunked_loss_and_logits,
    logits_unless_grad,
)
from fxopt.passes.chunked_loss import chunked_loss
from helpers import check_pass, seeded

VOCAB, HIDDEN, BATCH, SEQ = 251, 16, 2, 15  # 30 tokens: chunks of 8 leave 6; 251 is prime


def labels_with_ignored(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :11] = -100  # with the shift, the first chunk of 8 tokens is all ignored
    labels[1, 5] = -100
    return ids, labels


# ---------------------------------------------------------------------------------------------
# The runtime


def _reference(h, w, b, t, smoothing, reduction, transforms, shift, keep):
    z = F.linear(h, w, b)
    logits = z
    for i, transform in enumerate(transforms):
        if i == keep:
            logits = z
        kind = transform[0]
        z = (z.to(transform[1]) if kind == "to" else z * transform[1] if kind == "mul"
             else z / transform[1] if kind == "div" else torch.tanh(z))
    if keep == len(transforms):
        logits = z
    if shift:
        z = z[..., :-1, :]
    loss = F.cross_entropy(z.reshape(-1, w.shape[0]), t, label_smoothing=smoothing,
                           reduction=reduction)
    return loss, logits


SOFTCAP = (("div", 3.0), ("tanh",), ("mul", 3.0))


def test_runtime_is_cross_entropy_for_every_option():
    gen = torch.Generator().manual_seed(0)
    vocab = 13
    cases = itertools.product([0.0, 0.1], [(), SOFTCAP, (("mul", 0.5), ("to", torch.float64))],
                              [False, True], [False, True])
    for i, (smoothing, transforms, shift, want_logits) in enumerate(cases):
        reduction, bias, rows = ["mean", "sum"][i % 2], i % 3 != 0, [3, 64][i // 2 % 2]
        h = torch.randn(BATCH, 7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.randn(vocab, 5, dtype=torch.float64, generator=gen, requires_grad=True)
        b = torch.randn(vocab, dtype=torch.float64, generator=gen,
                        requires_grad=True) if bias else None
        labels = torch.randint(0, vocab, (BATCH, 7), generator=gen)
        labels[0, :6] = -100  # rows 0-5: two whole chunks of 3 ignored
        t = labels[:, 1:].reshape(-1) if shift else labels.reshape(-1)
        slices = ((1, 0, 6, 1),) if shift else ()
        params = [h, w] + ([b] if bias else [])
        for keep in range(len(transforms) + 1) if want_logits else [None]:
            loss, logits = _reference(h, w, b, t, smoothing, reduction, transforms, shift,
                                      keep or 0)
            cotangent = torch.randn(logits.shape, dtype=logits.dtype, generator=gen)
            options = dict(chunk_rows=rows, label_smoothing=smoothing, reduction=reduction,
                           transforms=transforms, row_slices=slices)
            if keep is None:
                got = chunked_loss_call(h, w, b, t, **options)
                expected = torch.autograd.grad(loss * 1.7, params)
                grads = torch.autograd.grad(got * 1.7, params)
            else:
                got, got_logits = chunked_loss_and_logits(h, w, b, t, logits_transforms=keep,
                                                          **options)
                torch.testing.assert_close(got_logits, logits)
                expected = torch.autograd.grad(loss * 1.7 + (logits * cotangent).sum(), params)
                grads = torch.autograd.grad(got * 1.7 + (got_logits * cotangent).sum(), params)
            torch.testing.assert_close(got, loss)
            for mine, theirs in zip(grads, expected):
                torch.testing.assert_close(mine, theirs)


def test_runtime_with_every_token_ignored_is_nan_with_zero_gradients_as_cross_entropy():
    h = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(7, 5, requires_grad=True)
    targets = torch.full((4,), -100)
    loss = chunked_loss_call(h, w, None, targets, chunk_rows=3)
    loss.backward()
    reference = F.cross_entropy(F.linear(h, w), targets)
    assert loss.isnan() and reference.isnan()
    assert not h.grad.any() and not w.grad.any()


def test_runtime_gradients_are_consumed_by_one_backward():
    h = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(7, 5, requires_grad=True)
    loss = chunked_loss_call(h, w, None, torch.tensor([1, 2, 3, -100]), chunk_rows=2)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("with_logits", [False, True])
def test_runtime_without_grad_computes_the_loss_only(no_grad, with_logits):
    # Parameters that require grad, as in an evaluation loop: no gradient may be made, so the
    # call holds no weight-sized buffer (the weight's gradient) and does one matmul per chunk.
    h = torch.randn(8, 64, requires_grad=True)
    w = torch.randn(1000, 64, requires_grad=True)
    targets = torch.tensor([1, 2, 3, -100, 0, 6, 999, 500])
    call = chunked_loss_and_logits if with_logits else chunked_loss_call
    tracker = LiveStorageTracker()
    with no_grad(), tracker:
        got = call(h, w, None, targets, chunk_rows=2)
    loss = got[0] if with_logits else got
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(h, w), targets))
    assert not loss.requires_grad
    logits_bytes = 8 * 1000 * 4 if with_logits else 0
    assert tracker.peak_bytes < logits_bytes + w.numel() * w.element_size() // 4


def test_logits_not_computed_says_why_and_no_grad_still_computes_them():
    h, w = torch.randn(3, 5, requires_grad=True), torch.randn(7, 5, requires_grad=True)
    placeholder = logits_unless_grad(h, w, None)
    assert isinstance(placeholder, LogitsNotComputed)
    for use in (lambda x: x.shape, lambda x: torch.softmax(x, -1), lambda x: x[0],
                lambda x: torch.ones(1) * x):
        with pytest.raises((AttributeError, RuntimeError), match="outputs='loss'"):
            use(placeholder)
    with torch.no_grad():
        logits = logits_unless_grad(h, w, None, transforms=SOFTCAP)
    torch.testing.assert_close(logits, torch.tanh(F.linear(h, w) / 3.0) * 3.0)


# ---------------------------------------------------------------------------------------------
# The pass on module-level and ATen graphs


class TinyLM(nn.Module):
    """Embedding -> two layers -> Linear head -> cross-entropy with Hugging Face's shift."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(),
                                    nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.layers(self.emb(ids)))
        shift_logits = logits[..., :-1, :].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, logits.size(-1)),
                               labels[..., 1:].contiguous().view(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


GOLDEN_BEFORE = """
    ids = input
    labels = input
    emb = emb:Embedding(ids)
    layers_0 = layers.0:Linear(emb)
    layers_1 = layers.1:GELU(layers_0)
    layers_2 = layers.2:Linear(layers_1)
    head = head:Linear(layers_2)
    getitem = getitem(head, [Ellipsis, slice(None, -1, None), slice(None, None, None)])
    contiguous = .contiguous(getitem)
    size = .size(head, -1)
    view = .view(contiguous, -1, size)
    getitem_1 = getitem(labels, [Ellipsis, slice(1, None, None)])
    contiguous_1 = .contiguous(getitem_1)
    view_1 = .view(contiguous_1, -1)
    cross_entropy = cross_entropy(view, view_1, weight=None, size_average=None, \
ignore_index=-100, reduce=None, reduction='mean', label_smoothing=0.0)
    return {'loss': cross_entropy, 'logits': head}
""".replace("\\\n", "")

GOLDEN_AFTER_ALL = """
    ids = input
    labels = input
    emb = emb:Embedding(ids)
    layers_0 = layers.0:Linear(emb)
    layers_1 = layers.1:GELU(layers_0)
    layers_2 = layers.2:Linear(layers_1)
    getitem_1 = getitem(labels, [Ellipsis, slice(1, None, None)])
    contiguous_1 = .contiguous(getitem_1)
    view_1 = .view(contiguous_1, -1)
    head_weight = @head.weight()
    head_bias = @head.bias()
    chunked_loss_and_logits = chunked_loss_and_logits(layers_2, head_weight, head_bias, view_1, \
chunk_rows=8, ignore_index=-100, label_smoothing=0.0, reduction='mean', transforms=[], \
row_slices=[[1, None, -1, 1]], logits_transforms=0)
    getitem_2 = getitem(chunked_loss_and_logits, 0)
    getitem_3 = getitem(chunked_loss_and_logits, 1)
    return {'loss': getitem_2, 'logits': getitem_3}
""".replace("\\\n", "")

GOLDEN_AFTER_LOSS = """
    ids = input
    labels = input
    emb = emb:Embedding(ids)
    layers_0 = layers.0:Linear(emb)
    layers_1 = layers.1:GELU(layers_0)
    layers_2 = layers.2:Linear(layers_1)
    getitem_1 = getitem(labels, [Ellipsis, slice(1, None, None)])
    contiguous_1 = .contiguous(getitem_1)
    view_1 = .view(contiguous_1, -1)
    head_weight = @head.weight()
    head_bias = @head.bias()
    logits_unless_grad = logits_unless_grad(layers_2, head_weight, head_bias, transforms=[])
    chunked_loss = chunked_loss(layers_2, head_weight, head_bias, view_1, chunk_rows=8, \
ignore_index=-100, label_smoothing=0.0, reduction='mean', transforms=[], \
row_slices=[[1, None, -1, 1]])
    return {'loss': chunked_loss, 'logits': logits_unless_grad}
""".replace("\\\n", "")


@pytest.mark.parametrize("outputs,golden", [("all", GOLDEN_AFTER_ALL), ("loss", GOLDEN_AFTER_LOSS)])
def test_golden_graphs_on_a_symbolic_traced_lm(outputs, golden):
    model = seeded(TinyLM)
    gm, result = check_pass(model, labels_with_ignored(), chunked_loss,
                            options={"outputs": outputs, "chunk_rows": 8},
                            golden_before=GOLDEN_BEFORE, golden_after=golden)
    site, = result.stats["sites"]
    assert (site["tokens"], site["vocab"], site["hidden"]) == (BATCH * SEQ, VOCAB, HIDDEN)
    assert ("not computed" in site["logits"]) == (outputs == "loss")
    output = gm(*labels_with_ignored())
    assert isinstance(output["logits"], LogitsNotComputed) == (outputs == "loss")
    with torch.no_grad():  # evaluation: the logits are computed in either mode
        torch.testing.assert_close(gm(*labels_with_ignored())["logits"],
                                   model(*labels_with_ignored())["logits"])


class Variant(nn.Module):
    """The spellings the pass reads: nll_loss of log_softmax, a soft-cap and a final scaling,
    nn.CrossEntropyLoss with label smoothing, tied embeddings through ``h @ E.T``, a tuple
    output (no ``loss`` to step from: random cotangents reach the returned logits too)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, ids, labels):
        h = self.layer(self.emb(ids))
        logits = h @ self.emb.weight.T if self.kind == "tied" else self.head(h)
        if self.kind == "nll":
            logp = F.log_softmax(logits.float(), dim=-1)
            return {"loss": F.nll_loss(logp.view(-1, VOCAB), labels.view(-1), reduction="sum")}
        if self.kind == "softcap":
            logits = torch.tanh(logits / 30.0) * 30.0 * 0.5
        if self.kind == "smoothing":
            return {"loss": self.loss_fn(logits.flatten(0, 1), labels.flatten())}
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return (loss, logits) if self.kind == "tuple" else {"loss": loss, "logits": logits}


@pytest.mark.parametrize("kind,capture_with", [
    ("nll", "fx"), ("nll", "export"), ("softcap", "fx"), ("softcap", "export"),
    ("smoothing", "fx"), ("tied", "fx"), ("tied", "export"), ("tuple", "fx")])
def test_every_spelling_is_rewritten_and_verified(kind, capture_with):
    gm, result = check_pass(seeded(Variant, kind), labels_with_ignored(), chunked_loss,
                            options={"chunk_rows": 8}, capture=capture_with)
    site, = result.stats["sites"]
    if kind == "softcap":
        assert site["transforms"] == [["div", "30.0"], ["tanh"], ["mul", "30.0"], ["mul", "0.5"]]
    assert not any(n.target in (F.cross_entropy, torch.ops.aten.cross_entropy_loss.default)
                   for n in gm.graph.nodes)


class Refused(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.per_token = nn.CrossEntropyLoss(reduction="none")
        if kind == "hooks":
            self.head.register_forward_hook(lambda module, args, out: None)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids)).flatten(0, 1)
        if self.kind == "weights":
            return F.cross_entropy(logits, labels.flatten(), weight=torch.ones(VOCAB))
        if self.kind == "none":
            return self.per_token(logits, labels.flatten())
        if self.kind == "scale_tensor":
            return F.cross_entropy(logits * self.head.bias[0], labels.flatten())
        if self.kind == "distill":
            return F.cross_entropy(logits, logits.argmax(-1))
        if self.kind == "not_projection":
            return F.cross_entropy(self.emb(ids).flatten(0, 1), labels.flatten() % HIDDEN)
        return F.cross_entropy(logits, labels.flatten())


@pytest.mark.parametrize("kind,reason", [
    ("weights", "class weights"), ("none", "per-token losses"), ("hooks", "has hooks"),
    ("scale_tensor", "not a projection"), ("distill", "computed from the logits"),
    ("not_projection", "not a projection")])
def test_what_it_cannot_prove_the_same_is_left_alone_with_a_reason(kind, reason):
    gm = capture(seeded(Refused, kind), labels_with_ignored(), capture="fx")
    code = gm.code
    result = chunked_loss(gm)
    assert result.modified is False and gm.code == code
    assert any(reason in why for why in result.stats["skipped"].values()), result.stats


def test_too_few_tokens_for_the_vocabulary_is_left_alone_unless_forced():
    ids = torch.zeros(1, 2, dtype=torch.long)
    gm = capture(seeded(TinyLM, VOCAB, 64), (ids, ids), capture="fx")
    result = chunked_loss(gm)
    assert not result.modified and "too few tokens" in str(result.stats["skipped"])
    assert chunked_loss(gm, force=True).modified


def test_options_are_checked_and_the_pass_runs_before_checkpointing():
    gm = capture(seeded(TinyLM), labels_with_ignored(), capture="fx")
    with pytest.raises(fxopt.ConfigError, match="outputs"):
        chunked_loss(gm, outputs="logits")
    with pytest.raises(fxopt.ConfigError, match="chunk_rows"):
        chunked_loss(gm, chunk_rows=0)
    order = passes.REGISTRY.canonical_order()
    assert order.index("chunked_loss") < order.index("checkpoint")
    assert passes.REGISTRY.lookup("chunked_loss") not in passes.REGISTRY.defaults()


# ---------------------------------------------------------------------------------------------
# Hugging Face causal LMs (torch.export-captured), built from configs


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
            use_cache=False)
        return seeded(transformers.LlamaForCausalLM, config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=2,
                                      n_positions=64, use_cache=False, bos_token_id=0,
                                      eos_token_id=0)
    return seeded(transformers.GPT2LMHeadModel, config)


@pytest.mark.parametrize("name,outputs", [("llama", "all"), ("gpt2", "loss")])
def test_hugging_face_causal_lm_is_verified_and_measured_lower(name, outputs):
    model = _hf(name)
    ids, labels = labels_with_ignored()
    kwargs = {"input_ids": ids, "labels": labels}
    gm = fxopt.optimize(model, (), example_kwargs=kwargs,
                        passes=[("chunked_loss", {"outputs": outputs, "chunk_rows": 8})],
                        predict_memory=False)  # verified by optimize itself
    record, _blocks = gm.fxopt_report.passes
    site, = record.stats["sites"]
    assert record.modified and site["tokens"] == BATCH * SEQ and site["vocab"] == VOCAB
    if name == "gpt2":  # tied: one Parameter is the embedding and the head
        assert model.lm_head.weight is model.transformer.wte.weight
    args = bind_keywords(model, (), kwargs)
    assert measure_train_step(gm, args).peak_bytes < measure_train_step(model, args).peak_bytes
    output = training_step(gm, args)
    assert isinstance(output.logits, LogitsNotComputed) == (outputs == "loss")


# ---------------------------------------------------------------------------------------------
# The planner


def test_a_memory_budget_brings_the_pass_in_with_the_chunk_left_to_the_plan():
    model, inputs = seeded(TinyLM), labels_with_ignored()
    gm = fxopt.optimize(model, inputs, memory_budget="min")
    records = {r.name: r for r in gm.fxopt_report.passes}
    chunked = records["chunked_loss"]
    site, = chunked.stats["sites"]
    assert chunked.modified and chunked.options == {"budget": "min"}
    assert site["chunk_rows"] == "open"  # sized by the checkpoint plan
    assert records["checkpoint"].stats["loss_chunk_rows"] >= MIN_CHUNK_ROWS  # (test_loss_chunk_plan)
    assert chunked.stats["predicted_after"] < chunked.stats["predicted_before"]
    assert 0 < site["loss_share_after"] < 1 and 0 < site["loss_share_before"] < 1
    # an explicit pass list is the user's choice: the budget adds checkpointing only
    listed = fxopt.optimize(model, inputs, memory_budget="min", passes=["reorder"],
                            verify=False, predict_memory=False)
    assert [r.name for r in listed.fxopt_report.passes] == ["checkpoint", "reorder", "keep_blocks"]


def test_chunk_rows_left_open_or_fixed():
    tokens, vocab, hidden = 1024, 32000, 256
    assert auto_chunk_rows(tokens, vocab, hidden, 4) == 64  # 8 MiB of float32 logits
    auto = decide(tokens, vocab, hidden, 4)
    assert auto.chunk and auto.chunk_rows is None  # open: auto_chunk_rows, or the plan's size
    assert auto.added_bytes == (vocab * hidden + tokens * hidden) * 4 + 2 * 64 * vocab * 4
    assert decide(tokens, vocab, hidden, 4, chunk_rows=100).chunk_rows == 100
    assert not decide(8, vocab, hidden, 4).chunk  # 8 tokens: nothing to gain
    assert decide(tokens, 100, hidden, 4).reason.startswith("the projection does not widen")


@pytest.mark.parametrize("outputs", ["all", "loss"])
def test_optimizing_the_optimized_module_again_changes_nothing(outputs):
    model, inputs = seeded(TinyLM), labels_with_ignored()
    once = fxopt.optimize(model, inputs, passes=[("chunked_loss", {"outputs": outputs})],
                          predict_memory=False)
    twice = fxopt.optimize(once, inputs, passes=[("chunked_loss", {"outputs": outputs})],
                           predict_memory=False)  # verified against the first
    assert twice.fxopt_report.trace.frontend == "fx"
    assert [(r.name, r.modified) for r in twice.fxopt_report.passes] == [
        ("chunked_loss", False), ("keep_blocks", False)]
    assert any(n.target in (chunked_loss_call, chunked_loss_and_logits)
               for n in twice.graph.nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits", [False, True])
def test_every_tensor_the_loss_makes_is_on_its_inputs_device(dtype, logits):
    """Forward and backward on ``meta`` tensors while the default device is the CPU: a tensor
    made without naming a device would land on the CPU and the next op mixing it with the
    inputs raises, as a CPU tensor in a CUDA model's backward would (the backward runs in
    autograd's engine, where ``default_device_elsewhere`` does not reach). Label smoothing and
    Hugging Face's upcast take the less common paths."""
    hidden = torch.randn(2, 12, 8, device="meta", dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 8, device="meta", dtype=dtype, requires_grad=True)
    bias = torch.randn(50, device="meta", dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (24,), device="meta")
    options = dict(chunk_rows=5, label_smoothing=0.1, transforms=(("to", torch.float32),))
    if logits:
        loss, out = chunked_loss_and_logits(hidden, weight, bias, targets, logits_transforms=1,
                                            **options)
        (loss + out.sum()).backward()
    else:
        chunked_loss_call(hidden, weight, bias, targets, **options).backward()
    assert {t.grad.device.type for t in (hidden, weight, bias)} == {"meta"}
