"""Real models from the libraries people train today, captured, optimized and verified.

A few small ones from ``models_zoo.ecosystem`` (random-init, built from configs, called as their
users call them), each picked for what broke before: transformers' decorated, keyword-only
forwards (GPT-2, Llama, BERT), diffusers' pytree-registered outputs (AutoencoderKL), a shape
check in the root forward (smp FPN), one module at two paths (monai DynUNet) and a model's own
in-place activations in a torch.export graph (monai UNETR, captured with ``dynamic=False``: the
static path on a real model, and the suite's costliest capture, a 12-layer ViT, in two traces
instead of three). ``benchmarks/coverage_ecosystem.py`` runs the whole catalogue. The libraries are the ``test`` extra; without them these tests skip.
"""

from __future__ import annotations

import pytest
import torch

import fxopt
from fxopt.core.trees import named_leaves, sketch
from fxopt.models_zoo import ecosystem

CASES = [  # (name, memory budget, dynamic sizes)
    ("hf_gpt2_lm", "min", True),
    ("hf_llama_lm", "min", True),
    ("hf_bert_classifier", None, True),
    ("diffusers_autoencoder_kl", None, True),
    ("smp_fpn", "min", True),
    ("monai_dynunet", "min", True),
    ("monai_unetr", "min", False),
]


def _model(name: str):
    library = ecosystem.library_of(name)
    if name not in ecosystem.names(library):
        why = dict(ecosystem.skipped(library))
        pytest.skip(f"{why.get(library) or why.get(name)} (install the test extra)")
    entry = ecosystem.get(name)
    model = entry.build()
    args, kwargs = entry.inputs(entry.default_batch)
    return model, args, kwargs


@pytest.mark.parametrize("name, budget, dynamic", CASES, ids=[c[0] for c in CASES])
def test_optimizes_verifies_and_returns_what_the_model_returns(name, budget, dynamic):
    model, args, kwargs = _model(name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gm = fxopt.optimize(model, args, example_kwargs=kwargs, memory_budget=budget,
                        dynamic=dynamic)
    report = gm.fxopt_report
    if not dynamic:
        assert report.trace.frontend == "export" and report.trace.traces == 2
    assert report.verification.ok, str(report.verification)
    assert report.verification.checked["param_grad"] > 0
    assert report.trace.leaves == []
    assert list(gm.state_dict()) == list(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # untouched
    if budget is not None:
        checkpoint = next(p for p in report.passes if p.name == "checkpoint")
        assert checkpoint.modified, checkpoint.stats
    model.eval()
    gm.eval()
    with torch.no_grad():
        expected, got = model(*args, **kwargs), gm(*args, **kwargs)
    assert type(got) is type(expected) and sketch(got) == sketch(expected)
    for (path, a), (_, b) in zip(named_leaves(expected), named_leaves(got)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b, a, msg=path)


def test_a_causal_lm_left_at_use_cache_gets_an_error_naming_use_cache_false():
    model, args, kwargs = _model("hf_gpt2_lm_use_cache")
    with pytest.raises(fxopt.TraceError) as info:
        fxopt.optimize(model, args, example_kwargs=kwargs)
    assert "DynamicCache" in info.value.what
    assert "use_cache=False" in info.value.hint
