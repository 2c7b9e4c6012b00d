"""fxopt.analysis.node_timing: one real forward per node, timed, leaving no trace on the model."""

import torch
from torch import nn

from fxopt.analysis.costmodel import node_costs
from fxopt.analysis.node_timing import forward_seconds
from fxopt.capture.trace import trace


def conv_bn_drop() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def test_every_call_node_is_timed_and_the_model_is_left_as_it_was():
    model = conv_bn_drop()
    gm = trace(model, torch.randn(2, 3, 8, 8))
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    seconds = forward_seconds(gm)
    calls = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert set(seconds) == set(calls) and all(s > 0 for s in seconds.values())
    for key, value in model.state_dict().items():  # BatchNorm ran in train mode, then restored
        assert torch.equal(value, buffers[key]), key
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew numbers, then restored
    assert all(p.grad is None for p in model.parameters())


def test_node_costs_use_the_measurement_and_the_roofline_without_it():
    gm = trace(conv_bn_drop(), torch.randn(2, 3, 8, 8))
    measured = forward_seconds(gm)
    profiled, roofline = node_costs(gm), node_costs(gm, profile=False)
    assert set(profiled) == set(roofline) == set(measured)
    assert all(profiled[n].flops == roofline[n].flops for n in profiled)
    # the profile is a real timing: not the roofline figure
    assert any(profiled[n].seconds != roofline[n].seconds for n in profiled)


def test_a_model_on_the_meta_device_is_not_run():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gm = trace(model, torch.randn(2, 4, device="meta"))
    assert forward_seconds(gm) == {}


def test_a_short_forward_is_timed_twice_and_a_long_one_once(monkeypatch):
    from fxopt.analysis import node_timing
    gm = trace(conv_bn_drop(), torch.randn(2, 3, 8, 8))
    runs = []
    run = node_timing._TimedInterpreter.run
    monkeypatch.setattr(node_timing._TimedInterpreter, "run",
                        lambda self, *args: runs.append(1) or run(self, *args))
    forward_seconds(gm)
    assert len(runs) == 2  # the second run drops first-run costs from the fastest times
    runs.clear()
    monkeypatch.setattr(node_timing, "ONE_RUN_SECONDS", 0.0)
    assert forward_seconds(gm)
    assert len(runs) == 1
