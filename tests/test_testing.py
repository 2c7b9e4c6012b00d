"""fxopt.testing.assert_equivalent and fxopt.check: pass on a correct pipeline, fail (naming the
tensor) on planted bugs, including one that only shows at another batch size."""

import json

import pytest
import torch
from torch import nn

import fxopt.passes as registry
from fxopt.check import SCHEMA, check_equivalence, random_inputs_like
from fxopt.core.errors import ConfigError
from fxopt.rewrite.pass_base import PassResult, mark_new
from fxopt.testing import assert_equivalent


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Dropout(0.2), nn.Linear(5, 3))


def _double_if_single(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.shape[0] == 1 else x


def _wrap_output(fn, name):
    def planted(gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        value = out.args[0]
        with gm.graph.inserting_before(out):
            new = mark_new(gm.graph.call_function(fn, (value,)), name)
        new.meta["val"] = value.meta["val"]
        out.args = (new,)
        return PassResult(gm, True, {})
    return planted


@pytest.fixture
def planted_passes(monkeypatch):
    planted = registry.REGISTRY
    for name, fn in [("off_by_a_bit", lambda x: x + 1e-2), ("batch_one_bug", _double_if_single)]:
        planted = planted.with_pass(registry.PassSpec(name, _wrap_output(fn, name), name,
                                                      default=False))
    monkeypatch.setattr(registry, "REGISTRY", planted)


def test_correct_pipeline_passes_and_returns_the_optimized_module():
    model = _model()
    optimized = assert_equivalent(model, torch.randn(4, 6), seeds=(0, 1), batch_sizes=(2, 4))
    assert isinstance(optimized, torch.fx.GraphModule)
    assert optimized.fxopt_report.passes  # the default pipeline ran


def test_planted_output_bug_fails_naming_the_tensor(planted_passes):
    with pytest.raises(AssertionError) as info:
        assert_equivalent(_model(), torch.randn(4, 6), passes=["off_by_a_bit"])
    message = str(info.value)
    assert "output 'output'" in message and "3 of 3 runs" in message
    assert "MISMATCH" in message


def test_bug_at_another_batch_size_needs_batch_sizes(planted_passes):
    model, x = _model(), torch.randn(4, 6)
    assert_equivalent(model, x, passes=["batch_one_bug"])  # invisible at batch 4
    result, _ = check_equivalence(model, x, passes=["batch_one_bug"], seeds=(0,),
                                  batch_sizes=(1, 4))
    assert not result.ok
    verdicts = [(run.batch_size, run.inputs, run.ok) for run in result.runs]
    assert verdicts == [(4, "example", True), (1, "random", False), (4, "random", True)]
    document = json.loads(json.dumps(result.as_dict()))
    assert document["schema"] == SCHEMA and document["summary"]["failed_runs"] == 1
    failing = document["runs"][1]["mismatches"]
    assert {m["kind"] for m in failing} >= {"output", "eval_output"}
    assert set(failing[0]) == {"kind", "name", "max_abs", "max_rel", "rtol", "atol", "detail"}


def test_random_inputs_keep_dtype_range_and_resize_the_batch():
    tokens = torch.tensor([[3, 4, 5], [6, 7, 3]])
    floats, ids = random_inputs_like((torch.zeros(2, 5), tokens), seed=1, batch_size=7)
    assert floats.shape == (7, 5) and floats.dtype == torch.float32 and floats.std() > 0
    assert ids.shape == (7, 3) and ids.dtype == torch.int64
    assert 3 <= int(ids.min()) and int(ids.max()) <= 7
    again = random_inputs_like((torch.zeros(2, 5), tokens), seed=1, batch_size=7)
    assert torch.equal(again[0], floats)


def test_bad_seeds_and_batch_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="seeds"):
        check_equivalence(_model(), torch.randn(2, 6), seeds=())
    with pytest.raises(ConfigError, match="batch sizes"):
        check_equivalence(_model(), torch.randn(2, 6), batch_sizes=(0,))
