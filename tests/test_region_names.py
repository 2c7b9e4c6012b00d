"""Checkpointed regions named as users know their model (issue: "You cannot tell what was
checkpointed on a Hugging Face model").

Regions were named by their ATen nodes (``_assert_tensor_metadata_default_6 .. reshape_3``);
each now carries the module path it runs in (``model.layers.1``, with the submodules it starts
and ends in), in the report and in the pass's stats (``RegionStats.module``). A ``"min"`` that
checkpoints nothing says why in words, and its ``budget_bytes`` is the peak it keeps, not 0.
"""

import pytest
import torch
from torch import nn

import fxopt
from fxopt.analysis.blocks import module_span

transformers = pytest.importorskip("transformers")


def checkpoint_stats(gm):
    return next(p for p in gm.fxopt_report.passes if p.name == "checkpoint").stats


@pytest.fixture(scope="module")
def llama_at_min():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, use_cache=False))
    ids = torch.randint(0, 64, (2, 8))
    return fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                          memory_budget="min", verify=False)


def test_regions_of_a_hugging_face_model_name_their_modules(llama_at_min):
    regions = checkpoint_stats(llama_at_min)["regions"]
    assert regions
    layers = [r for r in regions if r.module.startswith("model.layers.")]
    assert layers, [r.module for r in regions]
    for region in layers:
        number = region.module.split(".")[2]
        assert number.isdigit()  # the layer index, as the user numbers layers
        for inner in (region.from_module, region.to_module):
            assert inner.startswith(region.module)
    report = str(llama_at_min.fxopt_report)
    assert f"nodes in {layers[0].module}" in report
    assert region.as_dict()["module"] == region.module  # in the JSON report too


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
