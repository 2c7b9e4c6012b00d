"""One capture, several ``optimize`` calls: ``fxopt.capture_model`` and ``optimize(captured=...)``.

A budget sweep on a Hugging Face model captures once (three torch.export traces) instead of once
per budget. What is checked:

- a reused capture plans, predicts and verifies as a fresh capture does (deterministic plans:
  ``profile=False``), on torch.export (a Llama: dynamic sizes and a batch of one kept) and on
  symbolic tracing (a CNN with BatchNorm), and its report says it was reused;
- one capture serves a sweep of budgets and is never edited; the user's model is untouched;
- a capture of another model, of the model changed since, of other inputs, with other capture
  options or with opaque leaves is a ``ConfigError`` before any compute;
- with the default device elsewhere (``meta``) and the model in bfloat16, as a GPU run meets
  it, the reuse makes no tensor on the wrong device.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import fxopt
import fxopt.passes as builtin_passes
from device_mode import default_device_elsewhere, graphs_of
from fxopt import models_zoo
from fxopt.capture.reuse import reusable
from fxopt.core import meta_keys

# The default passes with checkpointing planned from the roofline: the same plan every run, so a
# reused capture's plan can be compared with a fresh one's.
PASSES = [(spec.name, {"profile": False} if spec.name == "checkpoint" else {})
          for spec in builtin_passes.REGISTRY if spec.default or spec.name == "checkpoint"]


class Counted(nn.Module):
    """conv-BN-ReLU twice and a head; counts its forward calls."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Dropout(0.0), nn.Conv2d(8, 8, 3, padding=1),
                                  nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        Counted.calls += 1
        return self.head(self.body(x).mean((2, 3)))


def counted():
    torch.manual_seed(0)
    return Counted(), torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": ids}


def _graphs(module: nn.Module) -> list[tuple[str, str]]:
    """Every graph the module runs (root, eval-mode graph, scoped and region bodies) as text."""
    return [(where, str(graph)) for where, graph in graphs_of(module)]


def _same_result(reused: fx.GraphModule, fresh: fx.GraphModule) -> None:
    assert reused.code == fresh.code
    for a, b in zip(reused.graph.nodes, fresh.graph.nodes):
        assert (a.op, a.target) == (b.op, b.target)
    ours, theirs = reused.fxopt_report, fresh.fxopt_report
    assert ours.predicted_before == theirs.predicted_before
    assert ours.predicted_after == theirs.predicted_after
    assert ours.verification.ok and theirs.verification.ok
    assert ours.trace.reused and not theirs.trace.reused
    assert "(by fxopt.capture_model, reused)" in str(ours)
    assert meta_keys.CAPTURED not in reused.meta
    assert [p.name for p in ours.passes if p.modified] == [p.name for p in theirs.passes
                                                           if p.modified]


@pytest.mark.filterwarnings("ignore:fxopt optimized a LlamaForCausalLM")
def test_a_reused_export_capture_plans_as_a_fresh_one_and_keeps_its_sizes_dynamic():
    model, kwargs = llama()
    captured = fxopt.capture_model(model, (), example_kwargs=kwargs)
    assert captured.meta[meta_keys.TRACE].frontend == "export"
    graphs = _graphs(captured)
    reused = fxopt.optimize(model, (), example_kwargs=kwargs, memory_budget="min",
                            passes=PASSES, captured=captured)
    fresh = fxopt.optimize(model, (), example_kwargs=kwargs, memory_budget="min", passes=PASSES)
    _same_result(reused, fresh)
    assert _graphs(reused) == _graphs(fresh)
    assert _graphs(captured) == graphs  # the capture's graphs, scoped bodies included, as made
    assert any(p.name == "checkpoint" and p.modified for p in reused.fxopt_report.passes)
    # the copy took a fraction of what capturing took
    assert reused.fxopt_report.seconds["capture"] < captured.meta[meta_keys.TRACE].seconds / 2
    for batch, length in ((3, 9), (1, 16)):  # other sizes and a batch of one, as captured
        ids = torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            torch.testing.assert_close(reused(input_ids=ids, labels=ids).loss,
                                       model(input_ids=ids, labels=ids).loss)


def test_one_capture_serves_a_budget_sweep_and_is_never_edited():
    model, inputs = models_zoo.build("unet", batch_size=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    captured = fxopt.capture_model(model, inputs)
    graphs, meta = _graphs(captured), dict(captured.meta)
    for budget in (0.8, "min"):
        reused = fxopt.optimize(model, inputs, memory_budget=budget, passes=PASSES,
                                captured=captured)
        fresh = fxopt.optimize(model, inputs, memory_budget=budget, passes=PASSES)
        _same_result(reused, fresh)
        assert [p is q for p, q in zip(reused.parameters(), model.parameters())] == [True] * len(
            list(model.parameters()))
    assert (_graphs(captured), captured.meta) == (graphs, meta)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training


def _not_a_capture(model, x):
    return fx.symbolic_trace(model), {}


def _another_model(model, x):
    return fxopt.capture_model(copy.deepcopy(model), x), {}


def _attribute_set(model, x):
    captured = fxopt.capture_model(model, x)
    model.body[3].p = 0.5
    return captured, {}


def _parameter_replaced(model, x):
    captured = fxopt.capture_model(model, x)
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    return captured, {}


def _put_in_eval_mode(model, x):
    captured = fxopt.capture_model(model, x)
    model.eval()
    return captured, {}


def _other_inputs(model, x):
    return fxopt.capture_model(model, torch.randn(4, 3, 8, 8)), {}


def _other_frontend(model, x):
    return fxopt.capture_model(model, x, capture="fx"), {"capture": "export"}


REFUSED = {
    _not_a_capture: "takes what fxopt.capture_model returned",
    _another_model: "capture of another Counted object",
    _attribute_set: "changed since it was captured",
    _parameter_replaced: "Parameter head.weight is another object",
    _put_in_eval_mode: "changed since it was captured",
    _other_inputs: "changed since it was captured",
    _other_frontend: "differ from the capture's",
}


@pytest.mark.parametrize("make", list(REFUSED), ids=[f.__name__[1:] for f in REFUSED])
def test_a_capture_that_is_not_of_this_model_as_it_is_now_is_refused_before_any_compute(make):
    model, x = counted()
    captured, options = make(model, x)
    Counted.calls = 0
    with pytest.raises(fxopt.ConfigError) as caught:
        fxopt.optimize(model, x, memory_budget="min", captured=captured, **options)
    assert REFUSED[make] in caught.value.what
    assert caught.value.where == "optimize(captured=...)" and caught.value.hint
    assert Counted.calls == 0


class Gate(nn.Module):
    """Reads a tensor's value: an opaque leaf, run for real at capture (``leaf_tape``)."""

    def forward(self, x):
        return x * 2 if x.mean() > 0 else x


def test_a_capture_with_leaves_run_for_real_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 2))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    captured = fxopt.capture_model(model, x)
    assert not reusable(captured) and reusable(fxopt.capture_model(model[0], x))
    with pytest.raises(fxopt.ConfigError, match="opaque leaves \\(1\\)"):
        fxopt.optimize(model, x, captured=captured)
    assert fxopt.optimize(model, x).fxopt_report.verification.ok  # captured again: fine


def test_reused_with_the_default_device_elsewhere_in_bfloat16():
    model, x = counted()
    model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    with default_device_elsewhere():
        captured = fxopt.capture_model(model, x)
        reused = fxopt.optimize(model, x, memory_budget="min", captured=captured)
    assert reused.fxopt_report.verification.ok and reused.fxopt_report.trace.reused
    assert {t.device.type for t in [*reused.parameters(), *reused.buffers()]} == {"cpu"}


def test_a_capture_refuses_torch_save_and_a_deep_copy_still_names_its_model():
    """A capture names its model object (a weak reference), which a file cannot: torch.save says
    so in an ExportError instead of torch's TypeError about a weakref. A deep copy keeps naming
    the model, and its Parameters are copies, so reusing it is refused as another model's."""
    import io

    model, x = counted()
    captured = fxopt.capture_model(model, x)
    with pytest.raises(fxopt.ExportError) as caught:
        torch.save(captured, io.BytesIO())
    assert "Counted object" in caught.value.what and "state_dict()" in caught.value.hint
    copied = copy.deepcopy(captured)
    assert copied.meta[meta_keys.CAPTURED].model() is model
    with pytest.raises(fxopt.ConfigError, match="is another object"):
        fxopt.optimize(model, x, captured=copied)
