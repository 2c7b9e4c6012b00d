"""models_zoo: the registry, determinism, train steps, tracing, and the unknown-name error."""

import pytest
import torch
from torch import fx

from fxopt import models_zoo
from fxopt.core.errors import InputError
from fxopt.core.step import training_step

STEPPED = ["mnist_net", "unet", "resnet18", "resnet50", "mobilenet_v2", "densenet121", "mlp",
           "transformer_block", "transformer_lm", "odd_channel_cnn", "lstm_classifier",
           "grouped_cnn"]
BUILD_ONLY = ["resnet152"]

# Parameter counts worked out by hand from the layer sizes in the brief (conv: k*k*c_in/groups*c_out
# + c_out, BN/LayerNorm: 2*c, LSTM layer: 4*h*(in+h) + 8*h); torchvision's are its published ones.
PARAMETER_COUNTS = {
    "mnist_net": 320 + 18_496 + 1_179_776 + 1_290,
    "mlp": 235_500 + 45_150 + 11_325 + 760,
    "odd_channel_cnn": 840 + 60 + 16_260 + 120 + 54_100 + 200 + 1_010,
    "grouped_cnn": 168 + 12 + 228 + 24 + 120 + 24 + 390 + 60 + 310,
    # enc 824 + 3520 + 13952, bottleneck 55552, up3 8224, dec 27776 + 9280 + 2336, head 114
    "unet": 121_578,
    # 2 LayerNorms 256, q/k/v/out 4 * 4160, MLP 16640 + 16448
    "transformer_block": 49_984,
    # token emb 50257*100, positions 256*100, 2 blocks of 121300, final LN 200, head 5075957
    "transformer_lm": 5_025_700 + 25_600 + 2 * 121_300 + 200 + 5_075_957,
    "lstm_classifier": 612 + 2 * 10_656 + 185,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet152": 60_192_808,
    "mobilenet_v2": 3_504_872,
    "densenet121": 7_978_856,
}


def expected_output_shape(name: str, batch: int) -> tuple[int, ...]:
    return {
        "unet": (batch, 2, 64, 64),
        "transformer_block": (batch, 32, 64),
        "transformer_lm": (batch, 16, 50257),
        "lstm_classifier": (batch, 5),
    }.get(name, (batch, 1000) if "torchvision" in models_zoo.get(name).tags else (batch, 10))


def test_names_are_exactly_the_required_models():
    assert models_zoo.names() == sorted(STEPPED + BUILD_ONLY)
    assert all(models_zoo.get(n).name == n for n in models_zoo.names())
    assert "large" in models_zoo.get("resnet152").tags


@pytest.mark.parametrize("name", STEPPED + BUILD_ONLY)
def test_build_is_deterministic_and_leaves_global_rng_alone(name):
    entry = models_zoo.get(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        before = torch.get_rng_state()
        first = entry.build()
        assert torch.equal(torch.get_rng_state(), before)
        torch.manual_seed(2)  # a different global seed must not change the weights
        second = entry.build()
    assert first is not second
    assert all(m.training for m in first.modules())
    a, b = first.state_dict(), second.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sum(p.numel() for p in first.parameters()) == PARAMETER_COUNTS[name]


@pytest.mark.parametrize("name", STEPPED)
def test_example_inputs_are_deterministic_and_sized_by_batch(name):
    entry = models_zoo.get(name)
    before = torch.get_rng_state()
    for batch in (1, 3):
        first, second = entry.example_inputs(batch), entry.example_inputs(batch)
        assert isinstance(first, tuple) and len(first) == len(second) >= 1
        assert all(torch.equal(x, y) for x, y in zip(first, second))
        assert all(x.shape[0] == batch for x in first)
    assert torch.equal(torch.get_rng_state(), before)
    assert 1 <= entry.default_batch <= 8


def test_token_inputs_are_valid_ids():
    (tokens,) = models_zoo.get("transformer_lm").example_inputs(2)
    assert tokens.dtype == torch.int64 and tokens.shape == (2, 16)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 50257


@pytest.mark.parametrize("batch", [0, -1, 2.0])
def test_bad_batch_size_is_an_input_error(batch):
    with pytest.raises(InputError, match="positive integer batch size"):
        models_zoo.get("mlp").example_inputs(batch)


@pytest.mark.parametrize("name", STEPPED)
def test_train_step_gives_finite_outputs_and_gradients(name):
    model, inputs = models_zoo.build(name)
    batch = models_zoo.get(name).default_batch
    out = training_step(model, inputs)
    assert out.shape == expected_output_shape(name, batch)
    assert torch.isfinite(out).all()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name


def test_build_uses_the_requested_batch():
    model, (x,) = models_zoo.build("odd_channel_cnn", batch_size=5)
    assert x.shape == (5, 3, 32, 32)
    assert model(x).shape == (5, 10)


def test_mnist_net_outputs_log_probabilities():
    model, inputs = models_zoo.build("mnist_net")
    with torch.no_grad():
        log_probs = model.eval()(*inputs)
    torch.testing.assert_close(log_probs.exp().sum(dim=1), torch.ones(4))


def test_language_model_is_causal():
    model, (tokens,) = models_zoo.build("transformer_lm")
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 50257
    model.eval()
    with torch.no_grad():
        logits, changed_logits = model(tokens), model(changed)
    assert torch.equal(logits[:, :-1], changed_logits[:, :-1])
    assert not torch.equal(logits[:, -1], changed_logits[:, -1])


@pytest.mark.parametrize("name", STEPPED)
def test_symbolic_trace_matches_eager_in_eval_mode(name):
    model, inputs = models_zoo.build(name)
    model.eval()
    traced = fx.symbolic_trace(model)
    with torch.no_grad():
        torch.testing.assert_close(traced(*inputs), model(*inputs), rtol=0, atol=0)
    leaf_calls = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    assert ("lstm" in leaf_calls) == (name == "lstm_classifier")


def test_resnet152_traces():
    traced = fx.symbolic_trace(models_zoo.get("resnet152").build())
    assert sum(n.op == "call_module" for n in traced.graph.nodes) > 400


def test_unknown_name_lists_known_names_and_suggests_closest():
    with pytest.raises(InputError) as caught:
        models_zoo.get("resnet5")
    message = str(caught.value)
    assert "did you mean 'resnet50'?" in message
    assert all(name in message for name in models_zoo.names())
    with pytest.raises(InputError, match="unknown zoo model 'nothing_like_it'"):
        models_zoo.build("nothing_like_it")
