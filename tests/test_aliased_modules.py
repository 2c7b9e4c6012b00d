"""A submodule registered under two paths (monai's DynUNet does this) survives fake-tensor runs.

``module_state`` lists a shared parameter under each of its names; swapping the same slot once
per name and restoring it in the same order used to leave the fake stand-in in the slot, so
after ``estimate_peak`` or a pass's meta refresh the model's parameters were FakeTensors.
"""

import pytest
import torch
from helpers import Snapshot
from torch import nn

import fxopt
from fxopt.analysis import estimate_peak
from fxopt.graph.fake_run import on_fake_tensors
from fxopt.core.torch_private import FakeTensor


class Aliased(nn.Module):
    """One block under two attributes, one in a ModuleList and an attribute, a tied weight."""

    def __init__(self):
        super().__init__()
        shared = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        listed = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.a = shared
        self.b = shared
        self.stages = nn.ModuleList([listed])
        self.last = listed
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6)
        self.head.weight = self.proj.weight  # tied: two slots, one tensor

    def forward(self, x):
        x = self.b(self.a(self.stem(x)))
        x = self.last(self.stages[0](x))
        return self.head(torch.relu(self.proj(x.mean((2, 3)))))


def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    return state


def assert_real(module: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    now = tensors(module)
    fakes = [name for name, t in now.items() if isinstance(t, FakeTensor)]
    assert fakes == []
    assert list(now) == list(expected)
    replaced = [name for name, t in now.items() if t is not expected[name]]
    assert replaced == []


@pytest.fixture
def model_and_input():
    torch.manual_seed(0)
    return Aliased(), torch.randn(2, 3, 16, 16)


def test_fake_run_restores_every_aliased_slot(model_and_input):
    model, x = model_and_input
    before = tensors(model)
    assert model.a.state_dict().keys() and model.a is model.b and model.last is model.stages[0]
    with on_fake_tensors(model, x) as run:
        inside = tensors(model)
        assert all(isinstance(t, FakeTensor) for t in inside.values())
        assert inside["a.0.weight"] is inside["b.0.weight"] is run.state["a.0.weight"]
        assert inside["head.weight"] is inside["proj.weight"]  # tied weights stay tied
        model(*run.inputs).sum().backward()
    assert_real(model, before)


def test_estimate_peak_leaves_real_parameters(model_and_input):
    model, x = model_and_input
    before = tensors(model)
    estimate = estimate_peak(model, x)
    assert estimate.train_bytes > estimate.inference_bytes > 0
    assert_real(model, before)


@pytest.mark.parametrize("budget", [None, 0.7])  # 0.7: feasible, checkpoints
def test_optimize_keeps_the_users_parameters(model_and_input, budget):
    model, x = model_and_input
    snapshot = Snapshot(model)
    before = tensors(model)
    params = {id(p): p for p in model.parameters()}
    keys = list(model.state_dict())
    gm = fxopt.optimize(model, x, memory_budget=budget, passes=None)
    snapshot.assert_unchanged()
    assert_real(model, before)
    gm_params = dict(gm.named_parameters(remove_duplicate=False))
    assert gm_params and all(not isinstance(p, FakeTensor) and params.get(id(p)) is p
                             for p in gm_params.values())
    assert not any(isinstance(b, FakeTensor) for b in gm.buffers())
    assert list(model.state_dict()) == keys
    assert set(gm.state_dict()) <= set(keys)
    assert gm.fxopt_report.verification.ok
    if budget is not None:
        assert any(p.name == "checkpoint" and p.modified for p in gm.fxopt_report.passes)
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    assert torch.equal(gm(x), want)
