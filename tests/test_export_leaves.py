"""Leaves on the export path (issue 25, item 3): a model whose root only torch.export captures,
with a data-dependent submodule, is exported with that submodule kept as an opaque module call,
optimizes under a budget, verifies and predicts its peak; and no hint sends the user in a circle.
"""

import pytest
import torch
from torch import nn

import fxopt
from fxopt.capture.chain import capture
from fxopt.graph.leaf_tape import leaf_records, opaque_leaves
from fxopt.core.errors import TraceError
from fxopt.core.inputs import check_inputs
from fxopt.models_zoo.leaves import olmoe_eager_experts


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        if x.mean() > 0:
            return torch.relu(self.a(x))
        return torch.tanh(self.b(x))


class SizeBranchingRoot(nn.Module):
    """Branches on a size in its own forward: symbolic tracing stops at the root, torch.export
    follows it (a size is known while exporting), so only torch.export captures the model."""

    def __init__(self):
        super().__init__()
        self.inp, self.branch, self.out = nn.Linear(8, 16), Branch(), nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        if h.shape[0] > 1:
            h = h - h.mean(0, keepdim=True)
        return self.out(self.branch(h))


class BranchesInItsOwnForward(SizeBranchingRoot):
    def forward(self, x):
        h = self.inp(x)
        if h.shape[0] > 1 and h.sum() > 0:  # a size, then a value: no frontend follows it
            h = h * 2
        return self.out(torch.relu(h))


def test_export_keeps_the_data_dependent_submodule_as_a_module_call():
    torch.manual_seed(0)
    model, x = SizeBranchingRoot(), torch.randn(4, 8)
    gm = capture(model, (x,))
    info = gm.meta["fxopt_trace"]
    assert info.frontend == "export"
    assert [(leaf.path, leaf.module_type) for leaf in info.leaves] == [("branch", "Branch")]
    assert "torch.export cannot follow it" in info.leaves[0].reason
    calls = [n for n in gm.graph.find_nodes(op="call_module")]
    assert [n.target for n in calls] == ["branch"]  # the leaf, called as written
    assert not any("opaque_leaf" in str(n.target) for n in gm.graph.nodes)
    (record,) = leaf_records(gm)
    assert record.replays
    predicted = fxopt.estimate_peak(gm, (x,)).train_bytes
    assert predicted == fxopt.measure_train_step(gm, (x,)).peak_bytes
    assert fxopt.verify(model, gm, (x,)).ok


def test_leaf_modules_with_capture_export():
    torch.manual_seed(0)
    model, x = SizeBranchingRoot(), torch.randn(4, 8)
    gm = fxopt.optimize(model, x, capture="export", leaf_modules=("branch",), memory_budget="min")
    report = gm.fxopt_report
    assert report.trace.frontend == "export"
    assert report.trace.leaves == []  # named, not found: no fallback to report
    assert [leaf for leaf, _ in opaque_leaves(gm)] == [gm.branch]  # called, wherever it went
    assert report.predicted_after.train_bytes == fxopt.measure_train_step(gm, (x,)).peak_bytes


@pytest.mark.parametrize("frontend", ["auto", "export", "fx"])
def test_no_hint_sends_the_user_to_a_frontend_that_fails(frontend):
    model, x = BranchesInItsOwnForward(), torch.randn(4, 8)
    with pytest.raises(TraceError) as caught:
        fxopt.optimize(model, x, capture=frontend)
    hint = caught.value.hint
    for other in ("fx", "export"):  # neither frontend follows the root: none is recommended
        assert f"with capture='{other}'" not in hint and f"capture='{other}' (capture=" not in \
            hint, hint
    assert "fxopt.trace(" not in hint, hint
    assert "move that code into a submodule" in hint or "leaf_modules" in hint, hint


# ---------------------------------------------------------------- OLMoE's eager expert loop


@pytest.mark.slow
def test_olmoe_with_its_eager_expert_loop_captures_optimizes_at_min_and_verifies():
    pytest.importorskip("transformers")
    model, kwargs = olmoe_eager_experts()
    gm = fxopt.optimize(model, (), example_kwargs=kwargs, memory_budget="min")
    report = gm.fxopt_report  # verified: optimize raises otherwise
    assert report.trace.frontend == "export"
    assert [leaf.path for leaf in report.trace.leaves] == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert any(p.name == "checkpoint" and p.modified for p in report.passes)
    args = check_inputs(model, (), kwargs)
    # Recomputed in backward, the experts' F.one_hot allocates on fakes what its fake-friendly
    # decomposition does (arange + eq, a few hundred bytes), not the real kernel's aminmax +
    # scatter: the peak inside the recomputation is off by those bytes at most
    measured = fxopt.measure_train_step(gm, args).peak_bytes
    assert abs(report.predicted_after.train_bytes - measured) <= 1024
    assert report.predicted_after.train_bytes < report.predicted_before.train_bytes
    assert "same figures" in str(report)  # the experts' replay allocates what they did for real
