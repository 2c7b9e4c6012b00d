"""The model's own loss: when a model returns one, fxopt's training step is ``loss.backward()``.

``fxopt.core.step.step_loss`` decides what a step backpropagates; prediction (``estimate_peak``),
measurement (``measure``), verification and the checkpoint pass all run that one step. A causal
LM called with ``labels`` is the case that matters: random cotangents over every output would
add a ``batch x sequence x vocab`` cotangent for the logits that a real step never holds. Models
without a loss keep the random-cotangent step (tests/test_verify.py, tests/test_measure.py).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fxopt
from fxopt.analysis.estimate import estimate_peak, estimate_train_peak
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.core.inputs import bind_keywords
from fxopt.core.step import (
    FROM_LOSS,
    cotangents_for,
    differentiable_outputs,
    model_loss,
    step_loss,
    training_step,
)
from fxopt.core.tensors import storage_bytes
from fxopt.measure.peaks import measure_train_step

VOCAB, SEQ, BATCH = 8000, 128, 2


# ---------------------------------------------------------------- which loss, if any


class LossAndLogits(nn.Module):
    """Returns ``{"loss": ..., "logits": ...}`` (or another container), as HF models do."""

    def __init__(self, wrap=dict):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 50)
        self.wrap = wrap

    def forward(self, x, target):
        logits = self.head(torch.relu(self.body(x)))
        loss = nn.functional.cross_entropy(logits, target)
        return self.wrap(loss=loss, logits=logits)


@dataclass
class DataclassOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


TupleOutput = namedtuple("TupleOutput", ["logits", "loss"])


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 16, generator=gen), torch.randint(0, 50, (64,), generator=gen)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("wrap", [dict, DataclassOutput, TupleOutput],
                         ids=["dict", "dataclass", "namedtuple"])
def test_a_returned_loss_is_what_the_step_backpropagates(wrap):
    torch.manual_seed(0)
    model = LossAndLogits(wrap)
    x, target = _inputs()
    out = model(x, target)
    step = step_loss(out)
    assert step.from_loss and step.describe() == FROM_LOSS
    assert step.tensors == [model_loss(out)] and len(step.tensors) == 1
    assert torch.equal(step.cotangents[0], torch.ones(()))
    again = model(x, target)
    (again["loss"] if wrap is dict else again.loss).backward()
    expected = _grads(model)
    training_step(model, (x, target))
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)


def test_the_prediction_of_a_model_returning_its_loss_counts_no_logits_cotangent():
    torch.manual_seed(0)
    model = LossAndLogits()
    x, target = _inputs()
    logits_bytes = 64 * 50 * 4
    fxopt_peak = estimate_train_peak(model, (x, target)).bytes
    measured = measure_train_step(model, (x, target))
    assert measured.backward_from == FROM_LOSS
    assert fxopt_peak == measured.peak_bytes == _real_peak(model, (x, target))
    # the old step: random cotangents over loss and logits, one logits-sized tensor more
    assert _synthetic_peak(model, (x, target)) - fxopt_peak >= logits_bytes


class PerSampleLoss(nn.Module):
    def __init__(self, loss_kind: str):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.loss_kind = loss_kind

    def forward(self, x):
        y = self.lin(x)
        if self.loss_kind == "vector":       # per-sample losses: the reduction is unknown
            return {"loss": y.pow(2).mean(dim=1), "y": y}
        if self.loss_kind == "metric":       # does not require grad: not what is trained
            return {"loss": y.detach().mean(), "y": y}
        if self.loss_kind == "tuple":        # return_dict=False style: not detected on purpose
            return y.mean(), y
        if self.loss_kind == "nested":       # a loss deeper than the top level
            return {"out": {"loss": y.mean()}, "y": y}
        return {"logits": y}                 # no loss at all


@pytest.mark.parametrize("kind", ["vector", "metric", "tuple", "nested", "none"])
def test_outputs_without_a_usable_loss_keep_random_cotangents(kind):
    torch.manual_seed(0)
    model = PerSampleLoss(kind)
    out = model(torch.randn(3, 8))
    step = step_loss(out)
    assert model_loss(out) is None and not step.from_loss
    outs = differentiable_outputs(out)
    assert step.tensors == outs and step.describe().startswith("random cotangents")
    for got, want in zip(step.cotangents, cotangents_for(outs)):
        assert torch.equal(got, want)


def test_a_frozen_model_returning_a_loss_has_nothing_to_backpropagate():
    model = LossAndLogits().requires_grad_(False)
    out = model(*_inputs())
    assert model_loss(out) is None and step_loss(out).tensors == []


def _from_loss(out) -> None:
    (out["loss"] if isinstance(out, dict) else out.loss).backward()


def _from_every_output(out) -> None:
    outs = differentiable_outputs(out)
    torch.autograd.backward(outs, cotangents_for(outs))


def _step_peak(model: nn.Module, args: tuple, backward) -> int:
    """Whole-step peak of ``out = model(*args); backward(out)``, live storage on CPU."""
    for p in model.parameters():
        p.grad = None
    baseline = storage_bytes((list(model.parameters()), list(model.buffers()), args))
    tracker = LiveStorageTracker()
    with tracker:
        out = model(*args)
        backward(out)
        del out
    model.zero_grad(set_to_none=True)
    return baseline + tracker.peak_bytes


def _real_peak(model: nn.Module, args: tuple) -> int:
    """A real step: ``out.loss.backward()``."""
    return _step_peak(model, args, _from_loss)


def _synthetic_peak(model: nn.Module, args: tuple) -> int:
    """Random cotangents over every output: fxopt's step before."""
    return _step_peak(model, args, _from_every_output)


# ---------------------------------------------------------------- a Hugging Face causal LM


def _llama(layers: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
        use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def llama():
    return _llama(2)


def test_a_causal_lm_with_labels_is_predicted_and_measured_as_its_loss_backward(llama):
    model, kwargs = llama
    args = bind_keywords(model, (), kwargs)
    logits_bytes = BATCH * SEQ * VOCAB * 4
    real = _real_peak(model, args)
    measured = measure_train_step(model, (), example_kwargs=kwargs)
    predicted = estimate_peak(model, args)
    assert measured.backward_from == predicted.train_backward_from == FROM_LOSS
    assert measured.peak_bytes == real  # the same step, the same tracker: exact
    assert abs(predicted.train_bytes - real) <= 0.02 * real, (predicted.train_bytes, real)
    # random cotangents over every output held a logits-sized cotangent through backward
    synthetic = _synthetic_peak(model, args)
    assert synthetic - predicted.train_bytes >= 0.9 * logits_bytes, (synthetic, predicted)
    assert synthetic - measured.peak_bytes >= 0.9 * logits_bytes, (synthetic, measured)
    assert "training step: backward from the model's loss" in str(
        fxopt.measure(model, (), example_kwargs=kwargs))


def test_optimizing_a_causal_lm_with_labels_verifies_against_its_loss():
    # one decoder layer: what is checked is the step (the loss alone backpropagated), not how
    # the layers repeat, and capture and planning cost grows with each layer
    model, kwargs = _llama(1)
    gm = fxopt.optimize(model, (), example_kwargs=kwargs, memory_budget="min")
    report = gm.fxopt_report
    assert report.verification.ok, str(report.verification)
    assert report.verification.checked["param_grad"] > 0
    assert report.verification.checked["output"] >= 2  # loss and logits (and None fields)
    assert report.predicted_before.train_backward_from == FROM_LOSS
    assert report.predicted_after.train_backward_from == FROM_LOSS
    checkpoint = next(p for p in report.passes if p.name == "checkpoint")
    assert checkpoint.modified, checkpoint.stats
    assert report.predicted_after.train_bytes < report.predicted_before.train_bytes
    assert "training step: backward from the model's loss (output.loss) alone" in str(report)
