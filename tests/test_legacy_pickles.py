"""Optimized modules saved with ``torch.save`` by fxopt's earlier flat layout still load.

``tests/data/legacy_checkpointed_module.pt`` was written at commit 1bb83b5 (before the layered
packages) by ``torch.save({"module": fxopt.optimize(model, (x,),
passes="checkpoint{budget=0.8,profile=false}"), "state_dict": model.state_dict(), "x": x})``
for the ``_model()`` below, seeded with ``torch.manual_seed(0)``. Its pickle names
``fxopt.regions.CheckpointedRegion``, ``fxopt.trace.TraceInfo``, ``fxopt.report.Report``,
``fxopt.pipeline.PassRecord`` and ``fxopt.verify.VerifyReport``, and its generated code imports
``fxopt.regions.call_region``.
"""

from pathlib import Path

import torch
from torch import nn

DATA = Path(__file__).parent / "data" / "legacy_checkpointed_module.pt"


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 16 * 16, 4))


def test_module_saved_by_the_flat_layout_loads_and_matches_its_model():
    saved = torch.load(DATA, weights_only=False)
    loaded, x = saved["module"], saved["x"]
    assert any(type(v).__name__ == "CheckpointedRegion" for v in vars(loaded).values())
    model = _model()
    model.load_state_dict(saved["state_dict"])
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for module in (loaded, model):
        module.train()
        module(x).square().sum().backward()
    torch.testing.assert_close(loaded(x), model(x))
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.grad, grads[name])
    for name, buffer in model.named_buffers():  # BatchNorm updated once per forward, as the model
        torch.testing.assert_close(loaded.get_buffer(name), buffer)
    assert loaded.fxopt_report.verification.ok


def test_optimized_module_round_trips_through_torch_save(tmp_path):
    """``torch.load`` re-traces a saved GraphModule with its tracer class, which must be
    constructible without arguments (it was not before this test)."""
    import fxopt

    torch.manual_seed(0)
    model, x = _model(), torch.randn(2, 3, 16, 16)
    optimized = fxopt.optimize(model, (x,), passes="checkpoint{budget=0.8,profile=false}")
    torch.save(optimized, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert loaded.graph.python_code("self").src.count("call_region(") == \
        optimized.code.count("call_region(") > 0
    for module in (loaded, model):
        module(x).square().sum().backward()
    for (name, p), q in zip(loaded.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
