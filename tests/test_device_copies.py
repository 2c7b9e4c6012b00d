"""Copies of both models on another device, for the proof that cannot run on theirs
(``fxopt.verify.device_copies``).

Where the original's step does not fit a GPU even at batch 1, or the module serves the example's
batch only, ``optimize`` verifies on CPU copies. An export-captured module's input guard refuses
a device-type change, so the copies' guards move with them, and only where no graph names
another device type. This machine has no GPU: ``meta`` stands for the other device type (a graph
that still named ``cpu`` would make a tensor there and fail against the meta parameters), and
the CUDA test runs the real case where a GPU is present.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxopt
from fxopt.capture.export_devices import device_types_built_in
from fxopt.core.errors import InputError
from fxopt.capture.trace import trace
from fxopt.verify.device_copies import copies_on
from helpers import seeded

META, CPU = torch.device("meta"), torch.device("cpu")


class Masked(nn.Module):
    """Factory ops on ``x.device`` and a tensor constant: what torch.export records as device
    literals, which must follow the copy."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        causal = torch.ones(x.shape[1], x.shape[1], device=x.device, dtype=x.dtype).tril()
        scale = torch.tensor([0.5, 2.0], device=x.device, dtype=x.dtype)
        scores = (self.proj(x) @ x.transpose(1, 2)) * scale[0] + causal
        return self.norm(torch.relu(scores.softmax(-1) @ x) * scale[1])


class Autocast(Masked):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.proj(x)
        return self.norm(y.float())


X = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))


def _export_optimized(cls, dtype=torch.float32):
    model = seeded(cls).to(dtype)
    return model, fxopt.optimize(model, X.to(dtype), capture="export", memory_budget="min",
                                 dynamic=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_copies_of_an_export_capture_compute_on_another_device_type_and_leave_the_module(dtype):
    model, gm = _export_optimized(Masked, dtype)
    x = X.to(dtype)
    assert gm.fxopt_report.trace.frontend == "export"
    assert device_types_built_in(gm) == []  # every literal follows the module
    model_copy, gm_copy = copies_on(META, model, gm)
    for module in (model_copy, gm_copy):
        out = module(x.to(META))
        assert out.device == META and out.dtype == dtype
        out.sum().backward()
    assert gm_copy.proj.weight.grad.device == META
    assert gm_copy.proj.weight is model_copy.proj.weight  # what the originals share
    assert gm.proj.weight is model.proj.weight and gm.proj.weight.device == CPU
    moved = copy.deepcopy(gm).to(META)  # the user's own move, as verification's copies
    assert moved(x.to(META)).device == META
    with pytest.raises(InputError, match=rf"x of dtype {dtype} on meta \(where the module"):
        moved(x)  # the inputs must follow the module
    torch.testing.assert_close(gm(x), model(x))


class Followed(Masked):
    """``Masked`` written with tensor methods, which symbolic tracing records too."""

    def forward(self, x):
        causal = x.new_ones((x.shape[1], x.shape[1])).tril()
        scale = x.new_tensor([0.5, 2.0])
        scores = (self.proj(x) @ x.transpose(1, 2)) * scale[0] + causal
        return self.norm(torch.relu(scores.softmax(-1) @ x) * scale[1])


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_state_dict_assigned_from_another_device_type_takes_the_module_there(capture):
    """``load_state_dict(..., assign=True)`` with every tensor on another device type moves the
    optimized module as it moves the model, on both capture paths: it trains there; an export
    capture's guard refuses inputs left behind before any compute, and the next call runs. The
    deep copy keeps the model's state_dict keys (torch.fx's own registers the constant torch.export
    lifted as a buffer)."""
    model = seeded(Followed)
    gm = fxopt.optimize(model, X, capture=capture, memory_budget="min", dynamic=False)
    assert gm.fxopt_report.trace.frontend == capture
    moved = copy.deepcopy(gm)
    assert list(moved.state_dict()) == list(gm.state_dict()) == list(model.state_dict())
    moved.load_state_dict({k: v.to(META) for k, v in gm.state_dict().items()}, assign=True)
    out = moved(X.to(META))
    out.sum().backward()
    assert out.device == META and {p.grad.device for p in moved.parameters()} == {META}
    if capture == "export":
        with pytest.raises(InputError, match="where the module is"):
            moved(X)
    assert moved(X.to(META)).device == META
    torch.testing.assert_close(gm(X), model(X))  # the module it was copied from is untouched


def test_a_graph_with_a_device_type_built_in_is_not_copied_to_another():
    model, gm = _export_optimized(Autocast)
    named = device_types_built_in(gm)
    assert [kind for kind, _ in named] == ["cpu"] and "autocast scope" in named[0][1]
    with pytest.raises(InputError, match="with the device type cpu built into its graph"
                       ) as info:
        copies_on(META, model, gm)
    assert info.value.where == named[0][1]
    with pytest.raises(InputError, match="cannot run on another device type"):
        copy.deepcopy(gm).to(META)(X.to(META))
    model_copy, gm_copy = copies_on(CPU, model, gm)  # the same device type: nothing to refuse
    torch.testing.assert_close(gm_copy(X), model_copy(X))


def test_copies_share_what_the_models_share_and_are_not_the_originals():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

        def forward(self, x):
            return self.bn(self.conv(x))

    model = seeded(Net)
    gm = trace(model, torch.randn(2, 3, 8, 8))
    model_copy, gm_copy = copies_on(CPU, model, gm)
    assert model_copy.conv.weight is gm_copy.conv.weight
    assert model_copy.conv.weight is not model.conv.weight
    assert model_copy.bn.running_mean is gm_copy.bn.running_mean


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:fxopt optimized a LlamaForCausalLM")
def test_cuda_llama_captured_static_is_verified_on_cpu_copies():
    from helpers import TINY_LLAMA_VOCAB, tiny_llama, token_batch
    from fxopt.core.inputs import check_inputs
    from fxopt.verify.fitting import verify_where_it_fits

    model = tiny_llama().cuda()
    batch = {k: v.cuda() for k, v in token_batch(2, seq=16, vocab=TINY_LLAMA_VOCAB).items()}
    gm = fxopt.optimize(model, (), example_kwargs=batch, memory_budget="min", dynamic=False,
                        verify="cpu")
    assert gm.fxopt_report.verified_where.startswith("full size on the CPU")
    args = check_inputs(model, (), batch)
    short = verify_where_it_fits(model, gm, args, free_bytes=lambda device: 0)
    assert short.report.ok and short.where.startswith("full size on the CPU")
    assert next(gm.parameters()).device.type == "cuda"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autocast_built_in_is_a_clear_error_not_a_cpu_proof():
    class CudaAutocast(Masked):
        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = self.proj(x)
            return self.norm(y.float())

    model = seeded(CudaAutocast).cuda()
    with pytest.raises(InputError, match="device type cuda built into its graph") as info:
        fxopt.optimize(model, X.cuda(), capture="export", dynamic=False, verify="cpu")
    assert "cannot be copied to the CPU" in str(info.value)
