"""Checkpointed regions named as users know their model (issue: "You cannot tell what was
checkpointed on a Hugging Face model").

Regions were named by their ATen nodes (``_assert_tensor_metadata_default_6 .. reshape_3``);
each now carries the module path it runs in (``model.layers.1``, with the submodules it starts
and ends in), in the report and in the pass's stats (``RegionStats.module``). A ``"min"`` that
checkpoints nothing says why in words, and its ``budget_bytes`` is the peak it keeps, not 0.

On a Hugging Face model: ``test_regions_of_a_hugging_face_model_name_their_modules`` in
tests/test_blocks.py, on the 2-layer Llama that file optimizes at ``"min"`` (one optimize of it
serves both checks instead of one per file).
"""

import torch
from torch import nn

import fxopt
from fxopt.analysis.blocks import module_span


def checkpoint_stats(gm):
    return next(p for p in gm.fxopt_report.passes if p.name == "checkpoint").stats


def test_module_span_is_the_deepest_common_module():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x).relu())

    model = nn.Sequential(Block(), Block())
    gm = fxopt.trace(model, torch.randn(2, 4))
    nodes = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("1.")]
    relu = next(n for n in gm.graph.nodes if n.op in ("call_method", "call_function")
                and "relu" in str(n.target) and n.args[0].target == "1.a")
    assert module_span([nodes[0], relu, nodes[-1]]) == ("1", "1.a", "1.b")
    assert module_span([n for n in gm.graph.nodes if n.op == "placeholder"]) == ("", "", "")


def test_min_that_checkpoints_nothing_says_why_in_words():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    gm = fxopt.optimize(model, torch.randn(2, 256), memory_budget="min")
    stats = checkpoint_stats(gm)
    assert "regions" not in stats
    assert stats["budget_bytes"] == stats["predicted_before"] > 0  # not "budget_bytes=0 B"
    reason = stats["reason"]
    assert "nothing is checkpointed" in reason
    assert "parameters, buffers and inputs" in reason and "parameter gradients" in reason
    assert "activations" in reason
    assert "budget_bytes=0 B" not in str(gm.fxopt_report)
