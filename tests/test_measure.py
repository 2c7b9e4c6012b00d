"""Measured memory against hand-computed bytes; measuring leaves no trace."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.measure.peaks import (
    format_bytes,
    measure,
    measure_inference,
    measure_train_step,
)

F32 = 4


def three_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))


def test_three_layer_model_exact_bytes():
    model, x = three_layers(), torch.randn(2, 8)
    train = measure_train_step(model, x)
    params = (8 * 16 + 16 * 4) * F32
    assert (train.params_bytes, train.inputs_bytes, train.buffers_bytes) == (params, 2 * 8 * F32, 0)
    # Peak is at the last backward op, grad of w1 (16x8) being written, while alive are:
    # output o (2x4) and its cotangent (2x4), grad w2 (4x16), grad h (2x16), grad w1 (16x8).
    # The relu output (saved) and grad of r were released just before.
    step = (2 * 4 + 2 * 4 + 4 * 16 + 2 * 16 + 16 * 8) * F32
    assert train.step_peak_bytes == step == 960
    assert train.grads_at_peak_bytes == (4 * 16 + 16 * 8) * F32
    assert train.activations_at_peak_bytes == step - train.grads_at_peak_bytes
    assert train.peak_bytes == train.baseline_bytes + step
    # Inference: h (2x16) and relu(h) (2x16) are alive together; h is dropped before the last mm.
    inference = measure_inference(model, x)
    assert inference.step_peak_bytes == 2 * (2 * 16) * F32
    assert inference.grads_at_peak_bytes == 0


def test_views_and_inplace_ops_allocate_nothing():
    x = torch.randn(64)
    tracker = LiveStorageTracker()
    with tracker:
        y = x * 2          # 256 bytes
        v = y.view(8, 8)   # view: nothing
        t = v.t()          # view: nothing
        t.relu_()          # in place: nothing
        z = x.reshape(8, 8)  # view of a pre-existing tensor: nothing
    assert tracker.peak_bytes == 64 * F32
    del y, v, t, z


def test_frees_are_seen():
    tracker = LiveStorageTracker(record_timeline=True)
    x = torch.randn(256)
    with tracker:
        a = x + 1
        del a
        b = x + 2
    assert tracker.peak_bytes == 256 * F32 and tracker.current_bytes == 256 * F32
    del b


def test_measuring_leaves_no_trace():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    x = torch.randn(8, 4)
    model[0].weight.grad = marker = torch.ones(4, 4)
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    measure(model, x)
    assert model[0].weight.grad is marker and model[0].bias.grad is None
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training is False


def test_fake_tensor_run_matches_real_measurement():
    model, x = three_layers(), torch.randn(2, 8)
    real = measure_train_step(model, x).step_peak_bytes
    with FakeTensorMode() as mode:
        params = {k: mode.from_tensor(v).requires_grad_() for k, v in model.named_parameters()}
        fake_x = mode.from_tensor(x)
        tracker = LiveStorageTracker()
        with tracker:
            out = functional_call(model, params, (fake_x,))
            out.backward(torch.randn(out.shape))
    assert tracker.peak_bytes == real


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.0 MiB"
    assert format_bytes(5 * 2**30) == "5.0 GiB"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_cuda_allocator_figure():
    model = three_layers().cuda()
    x = torch.randn(2, 8, device="cuda")
    figure = measure_train_step(model, x)
    assert figure.method == "CUDA caching allocator"
    assert figure.step_peak_bytes >= 960
