"""A language model's head gradient handed to its fused optimizer step in rows (issue 36, item 2).

With a fused optimizer step (``fxopt.fuse_optimizer``) the chunked loss leaves the head weight's
gradient (vocab x hidden, the largest gradient of a language model) to that step: backward hands
it a function computing rows of it, and the step computes, adds (to a tied embedding's gradient),
steps and drops one block of rows at a time. What these tests hold it to:

- the parameters move exactly as the whole gradient moves them (SGD at lr 1: the update *is*
  the gradient), tied or untied, with a bias, label smoothing, ignored targets and a soft-cap;
- the whole head gradient is never made, and the step happens in backward, when the gradient is
  complete (the head's own node returns no gradient; the parameter's accumulate hook still
  fires);
- AdamW's fused kernel steps the row blocks as it steps the whole parameter;
- the memory estimate equals a real fused step, to the byte, on this path too;
- paused (fxopt's own runs), the gradient is made whole as before.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxopt
from fxopt.analysis.estimate import estimate_peak
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.core.step import training_step
from fxopt.core.training_setup import TrainingSetup
from fxopt.passes import embedding_rows as embedding_rows_pass
from fxopt.runtime.chunked_loss import chunked_loss
from fxopt.runtime.embedding_rows import embedding_rows
from fxopt.runtime.fused_step import paused
from device_mode import default_device_elsewhere
from helpers import check_pass

VOCAB, HIDDEN, TOKENS = 2000, 64, 96
SOFT_CAP = (("div", 8.0), ("tanh",), ("mul", 8.0))


class TinyLM(nn.Module):
    """Embedding, one layer, a head with a bias; the loss through ``chunked_loss``; the lookup
    through ``embedding_rows`` when ``rows_lookup`` (as ``passes.embedding_rows`` rewrites it),
    with a padding row."""

    def __init__(self, tied: bool, transforms: tuple = (), rows_lookup: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB if tied else 3000, HIDDEN, padding_idx=5)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        if tied:
            self.head.weight = self.embed.weight
        self.transforms, self.rows_lookup = transforms, rows_lookup

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        looked_up = (embedding_rows(self.embed.weight, ids, 5) if self.rows_lookup
                     else self.embed(ids))
        hidden = torch.tanh(self.layer(looked_up)) * 2.0
        return chunked_loss(hidden, self.head.weight, self.head.bias, targets, chunk_rows=32,
                            label_smoothing=0.1, transforms=self.transforms)


def _batch(model: TinyLM) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.embed.num_embeddings, (TOKENS,), generator=generator)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    targets[::5] = -100
    ids[::11] = 5  # the padding row: no gradient
    if model.embed.num_embeddings == VOCAB:  # some targets are the tokens looked up
        targets[1::7] = ids[1::7]
    return ids, targets


def _model(tied: bool, transforms: tuple = (), rows_lookup: bool = False) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(tied, transforms, rows_lookup)


@pytest.mark.parametrize("rows_lookup", [False, True], ids=["lookup", "rows_lookup"])
@pytest.mark.parametrize("transforms", [(), SOFT_CAP], ids=["plain", "soft_cap"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_rows_handed_over_move_the_parameters_as_the_whole_gradient(tied, transforms,
                                                                        rows_lookup):
    """SGD at lr 1 subtracts the gradient itself. The head's rows are recomputed in backward
    from the hidden states, the bias as forward read it (the bias is stepped first, in its
    bucket) and each token's log-sum-exp; a tied embedding's rows are added to them, made
    whole by torch's lookup or, with ``rows_lookup``, in rows too (the padding row's none)."""
    model = _model(tied, transforms, rows_lookup)
    batch = _batch(model)
    reference = copy.deepcopy(model)
    reference.rows_lookup = False
    reference(*batch).backward()
    fused = fxopt.fuse_optimizer(model, torch.optim.SGD, lr=1.0, step_slice_bytes=2**14)
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(*batch).backward()
        fused.step()
    finally:
        fused.remove()
    assert fused.rows_per_block(model.head.weight) < VOCAB  # stepped in several blocks
    for name, p in model.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        # atol: before - after rounds to the parameters' last bit (up to 4.8e-7 here)
        torch.testing.assert_close(before[name] - p.detach(), expected, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


class _Sizes(TorchDispatchMode):
    """Counts the storages of ``nbytes`` bytes that ops make (views and detached aliases of an
    existing storage are not new)."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes, self.seen = nbytes, set()
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.nbytes() == self.nbytes and id(storage) not in before and \
                    storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.made += 1
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("tied,rows_lookup", [(False, False), (True, False), (True, True)],
                         ids=["untied", "tied", "tied_rows_lookup"])
def test_the_whole_head_gradient_is_never_made_and_the_step_runs_in_backward(tied, rows_lookup):
    """Untied, no vocab x hidden tensor is made at all; tied, only the embedding's own gradient
    (torch's lookup makes it whole), and none when the lookup hands its rows over too. Paused,
    the head's gradient is made whole in forward, as without a fused step. Either way the head
    is updated by the end of backward: its accumulate hook fires although no node returned a
    gradient for it."""
    model = _model(tied, rows_lookup=rows_lookup)
    batch = _batch(model)
    fused = fxopt.fuse_optimizer(model, torch.optim.AdamW, lr=1e-3, step_slice_bytes=2**14)
    head = model.head.weight
    try:
        model(*batch).backward()  # AdamW's moments exist from here on
        fused.step()
        before = head.detach().clone()
        sizes = _Sizes(head.numel() * head.element_size())
        with sizes:
            model(*batch).backward()
        assert sizes.made == (1 if tied and not rows_lookup else 0)
        assert not torch.equal(before, head.detach())  # stepped in backward
        assert head.grad is None
        fused.step()
        with paused(model.parameters()), _Sizes(head.numel() * head.element_size()) as whole:
            model(*batch).backward()
        assert whole.made > sizes.made and head.grad is not None  # made whole in forward
    finally:
        fused.remove()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_adamw_fused_kernel_trains_in_rows_as_on_the_whole_gradient(tied):
    """AdamW(fused=True), the GPU setup: three steps with the rows handed over against three
    with the ordinary optimizer on the whole gradient."""
    model = _model(tied)
    batch = _batch(model)
    reference = copy.deepcopy(model)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    fused = fxopt.fuse_optimizer(model, torch.optim.AdamW, lr=1e-3, fused=True,
                                 step_slice_bytes=2**14)
    try:
        for _ in range(3):
            reference(*batch).backward()
            plain.step()
            plain.zero_grad()
            model(*batch).backward()
            fused.step()
    finally:
        fused.remove()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


class _LossOf(nn.Module):
    def __init__(self, model: TinyLM, batch: tuple):
        super().__init__()
        self.model = model
        self.register_buffer("targets", batch[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, self.targets)


def _step_in_rows(tied: bool, rows_lookup: bool, hooks=contextlib.nullcontext):
    """A second AdamW step fused into backward (the first made its state), taking the head in
    rows: its predicted peak, and its measured peak under ``hooks()``."""
    model = _model(tied, rows_lookup=rows_lookup)
    batch = _batch(model)
    wrapped = _LossOf(model, batch)
    fused = fxopt.fuse_optimizer(wrapped, torch.optim.AdamW, lr=1e-3, step_slice_bytes=2**14)
    try:
        training_step(wrapped, (batch[0],))
        fused.step()
        estimate = estimate_peak(wrapped, (batch[0],), fused_optimizer=fused)
        tracker = LiveStorageTracker()
        with tracker, hooks():
            training_step(wrapped, (batch[0],))
            fused.step()
    finally:
        fused.remove()
    return estimate, tracker.peak_bytes


@pytest.mark.parametrize("tied,rows_lookup", [(False, True), (True, False), (True, True)],
                         ids=["untied_rows_lookup", "tied", "tied_rows_lookup"])
def test_the_estimate_equals_a_real_step_that_takes_the_head_in_rows(tied, rows_lookup):
    estimate, measured = _step_in_rows(tied, rows_lookup)
    assert estimate.train_bytes - estimate.baseline_bytes == measured


@pytest.mark.parametrize("rows_lookup", [False, True], ids=["head", "head_and_lookup"])
def test_saved_tensor_hooks_around_the_step_keep_the_head_in_rows(rows_lookup):
    """A loop under saved-tensor hooks (``torch.autograd.graph.save_on_cpu``, activation
    offloading; fxopt's own estimate watches what backward takes back this way) gets back
    other tensor objects than forward saved: the tied head's gradient still goes to its fused
    step in rows, never whole, so the step peaks no higher than without the hooks."""
    def detaching():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)

    _, plain = _step_in_rows(True, rows_lookup)
    _, hooked = _step_in_rows(True, rows_lookup, detaching)
    assert hooked == plain


def test_bfloat16_weights_with_the_loss_upcast_step_in_rows_on_any_device():
    """The GPU setup on a CPU: bfloat16 weights (initialised small, as language models are),
    the logits upcast to float32 for the loss (as Hugging Face computes it). SGD at lr 100
    moves each parameter by 100 times its gradient, through rows or whole; every tensor the rows
    path makes is made where the model is (the default device is ``meta`` meanwhile)."""
    torch.manual_seed(0)
    model = TinyLM(True, (("to", torch.float32),), rows_lookup=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.02)
    model = model.to(torch.bfloat16)
    batch = _batch(model)
    reference = copy.deepcopy(model)
    reference.rows_lookup = False
    before = copy.deepcopy(model)
    plain = torch.optim.SGD(reference.parameters(), lr=100.0)
    fused = fxopt.fuse_optimizer(model, torch.optim.SGD, lr=100.0, step_slice_bytes=2**13)
    try:
        with default_device_elsewhere():
            reference(*batch).backward()
            plain.step()
            model(*batch).backward()
            fused.step()
    finally:
        fused.remove()
    moved = (model.head.weight.float() - before.head.weight.float()).abs().max()
    assert moved > 1e-2  # the step is far above the tolerance below
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == torch.bfloat16
        # bfloat16 rounds the gradient and the parameter to 8 bits: a last bit may differ
        torch.testing.assert_close(p, q, rtol=1.6e-2, atol=2.5e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tensor_the_rows_path_makes_is_on_the_models_device(optimizer, dtype):
    """The model and its batch on ``meta`` tensors, the default device the CPU: the lookup's
    and the head's rows, their sum and the step in blocks all run in backward, where
    ``default_device_elsewhere`` (the test above) does not reach, so a tensor made there
    without naming a device lands on the CPU and the next op mixing it with the model raises,
    as a CPU tensor in a CUDA model's backward would. (AdamW's ``fused=True`` kernel refuses
    meta tensors; its rows are checked against the whole gradient above.)"""
    torch.manual_seed(0)
    model = TinyLM(True, (("to", torch.float32),), rows_lookup=True).to(dtype)
    batch = tuple(t.to("meta") for t in _batch(model))
    model = model.to("meta")
    fused = fxopt.fuse_optimizer(model, optimizer, lr=1e-3, step_slice_bytes=2**13)
    try:
        assert fused.rows_per_block(model.head.weight) < VOCAB  # stepped in several blocks
        for _ in range(2):  # the second step reads the state the first one made
            model(*batch).backward()
            fused.step()
    finally:
        fused.remove()
    state = [v for per_parameter in fused.optimizer.state.values()  # AdamW's step count is
             for v in per_parameter.values()  # a CPU scalar, as torch keeps it for AdamW itself
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    parameters = list(model.parameters())
    assert {t.device.type for t in [*parameters, *state]} == {"meta"}
    if optimizer is torch.optim.AdamW:  # the moments of every parameter, the head's in blocks
        assert len(state) >= 2 * len(parameters)


# The pass: every lookup of a parameter the fused step frees becomes an ``embedding_rows`` call


class Lookups(nn.Module):
    """An ``nn.Embedding`` call, ``F.embedding`` with a negative padding index (rewritten); a
    ``max_norm`` lookup, which renormalises its weight in place, and a frozen one (left)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(300, 16)
        self.positions = nn.Parameter(torch.randn(12, 16))
        self.capped = nn.Embedding(300, 16, max_norm=1.0)
        self.frozen = nn.Embedding(300, 16).requires_grad_(False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return (self.tokens(ids) + F.embedding(pos, self.positions, padding_idx=-2)
                + self.capped(ids) + self.frozen(ids))


LOOKUPS_BEFORE = """
    ids = input
    pos = input
    tokens = tokens:Embedding(ids)
    positions = @positions()
    embedding = embedding(pos, positions, padding_idx=-2, max_norm=None, norm_type=2.0, \
scale_grad_by_freq=False, sparse=False)
    add = add(tokens, embedding)
    capped = capped:Embedding(ids)
    add_1 = add(add, capped)
    frozen = frozen:Embedding(ids)
    add_2 = add(add_1, frozen)
    return add_2
""".replace("\\\n", "")

LOOKUPS_AFTER = """
    ids = input
    pos = input
    tokens_weight = @tokens.weight()
    embedding_rows = embedding_rows(tokens_weight, ids, -1)
    positions = @positions()
    embedding_rows_1 = embedding_rows(positions, pos, 10)
    add = add(embedding_rows, embedding_rows_1)
    capped = capped:Embedding(ids)
    add_1 = add(add, capped)
    frozen = frozen:Embedding(ids)
    add_2 = add(add_1, frozen)
    return add_2
"""


def test_golden_graphs_of_the_lookups_a_fused_step_takes_in_rows():
    torch.manual_seed(0)
    model = Lookups()
    inputs = (torch.randint(0, 300, (2, 12)), torch.arange(12).expand(2, 12))
    fused = fxopt.fuse_optimizer(model, torch.optim.AdamW, lr=1e-3)
    try:
        _, result = check_pass(model, inputs, embedding_rows_pass,
                               options={"training": TrainingSetup(fused_optimizer=fused)},
                               golden_before=LOOKUPS_BEFORE, golden_after=LOOKUPS_AFTER)
        assert result.stats["rewritten"] == ["embedding_rows", "embedding_rows_1"]
    finally:
        fused.remove()
    # without a fused step (nothing frees a gradient in backward) the pass leaves the graph
    _, result = check_pass(model, inputs, embedding_rows_pass, golden_after=LOOKUPS_BEFORE,
                           expect_modified=False, numerics=False)
    assert "no fused optimizer step" in result.stats["skipped"]


def test_a_hugging_face_llama_optimized_with_the_fused_step_trains_like_the_original():
    """``optimize(..., fused_optimizer=fused, memory_budget="min", outputs="loss")`` on an
    untied Llama: both vocabulary-sized gradients (token embedding, head) go to the step in
    rows; two AdamW steps match the original model's with the ordinary AdamW."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    # 2 x 32 tokens: at 2 x 16 the chunked loss leaves the head alone ("too few tokens (32) for
    # the vocabulary (2000)"), and the head's gradient would not come in rows
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    kwargs = {"input_ids": ids, "labels": ids}
    fused = fxopt.fuse_optimizer(model, torch.optim.AdamW, lr=1e-3, step_slice_bytes=2**14)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    try:
        gm = fxopt.optimize(model, (), example_kwargs=kwargs, memory_budget="min",
                            outputs="loss", fused_optimizer=fused)
        records = {r.name: r.stats for r in gm.fxopt_report.passes}
        assert len(records["embedding_rows"]["rewritten"]) == 1
        for _ in range(2):
            reference(**kwargs).loss.backward()
            plain.step()
            plain.zero_grad()
            gm(**kwargs).loss.backward()
            assert model.model.embed_tokens.weight.grad is None  # stepped in backward
            fused.step()
    finally:
        fused.remove()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
