"""Config resolution, the pass loop, lint between passes, and graph dumps."""

import pytest
import torch
from torch import nn

from fxopt.capture.trace import trace
from fxopt.core.errors import BudgetError, ConfigError, InputError, PassError
from fxopt.rewrite.pass_base import PassResult, mark_new
from fxopt.rewrite.pipeline import Config, parse_pass_spec, run_passes
from fxopt.rewrite.registry import PassRegistry, PassSpec


def _noop(gm, *, scale: float = 1.0):
    return PassResult(gm, False, {"scale": scale})


def _double_output(gm):
    """Insert ``out * 2`` before the output, with provenance and meta."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    with gm.graph.inserting_before(out):
        doubled = gm.graph.call_function(torch.mul, (value, 2))
    doubled.meta["val"] = value.meta["val"] * 2
    mark_new(doubled, "double")
    out.args = (doubled,)
    return PassResult(gm, True, {"inserted": 1})


def _no_provenance(gm):
    result = _double_output(gm)
    next(n for n in gm.graph.nodes if n.target is torch.mul).meta.pop("fxopt_pass")
    return result


def _lies_unmodified(gm):
    _double_output(gm)
    return PassResult(gm, False)


def _crashes(gm):
    raise RuntimeError("boom")


def _analysis_refuses(gm):
    raise InputError("Net cannot run on fake tensors", where="estimate_peak(Net)")


def _type_error_inside(gm):
    return len(5)  # a bug in the pass, not bad options


def _over_budget(gm):
    raise BudgetError("budget 10 bytes cannot be met", hint="raise it")


@pytest.fixture
def fake_registry(monkeypatch):
    specs = []
    for name, fn, aliases in [
        ("first", _noop, ("f",)),
        ("double", _double_output, ()),
        ("no_provenance", _no_provenance, ()),
        ("lies", _lies_unmodified, ()),
        ("crashes", _crashes, ()),
        ("refuses", _analysis_refuses, ()),
        ("over_budget", _over_budget, ()),
        ("type_error", _type_error_inside, ()),
        ("helps", _takes_budget, ()),
        ("keeps_budget", _takes_budget, ()),
        ("plans", _reads_training, ()),
    ]:
        specs.append(PassSpec(name, fn, name, default=name in ("first", "double"),
                              aliases=aliases, budget=BUDGET_ROLES.get(name),
                              reads_training=name == "plans"))
    return PassRegistry(specs)


BUDGET_ROLES = {"helps": "joins", "keeps_budget": "keeps"}


def _takes_budget(gm, *, budget=None):
    return PassResult(gm, False, {"budget": budget})


def _reads_training(gm, *, training=None):
    return PassResult(gm, False, {"training": training})


def _gm():
    return trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), torch.randn(2, 3))


def test_parse_pass_spec():
    assert parse_pass_spec("inplace,checkpoint{budget=0.5, exact=true},reorder") == [
        ("inplace", {}), ("checkpoint", {"budget": 0.5, "exact": True}), ("reorder", {}),
    ]
    assert parse_pass_spec("checkpoint{budget=2GiB}") == [("checkpoint", {"budget": "2GiB"})]
    with pytest.raises(ConfigError, match="no '='"):
        parse_pass_spec("checkpoint{budget}")
    with pytest.raises(ConfigError, match="cannot parse"):
        parse_pass_spec("a,,{x=1}")


def test_defaults_aliases_and_order(fake_registry):
    assert [s.name for s, _ in Config().resolved(fake_registry)] == ["first", "double"]
    assert [s.name for s, _ in Config(passes="f{scale=2}").resolved(fake_registry)] == ["first"]
    with pytest.raises(ConfigError) as info:
        Config(passes=["double", "first"]).resolved(fake_registry)
    assert ("first, double, no_provenance, lies, crashes, refuses, over_budget, type_error, "
            "helps, keeps_budget, plans" in str(info.value))
    with pytest.raises(ConfigError, match="unknown pass 'nope'"):
        Config(passes=["nope"]).resolved(fake_registry)
    with pytest.raises(ConfigError, match="twice"):
        Config(passes=["first", "f"]).resolved(fake_registry)


def test_a_budget_brings_in_the_passes_that_declare_a_part_in_it(fake_registry):
    """The pass that keeps a budget joins any list; one that helps joins the default pipeline;
    both get the budget as their option unless the list sets it."""
    plan = Config(passes=["first"], memory_budget="1GiB").resolved(fake_registry)
    assert [(s.name, o) for s, o in plan] == [("first", {}), ("keeps_budget", {"budget": "1GiB"})]
    plan = Config(memory_budget="min").resolved(fake_registry)
    assert [(s.name, o) for s, o in plan] == [
        ("first", {}), ("double", {}), ("helps", {"budget": "min"}),
        ("keeps_budget", {"budget": "min"})]
    plan = Config(passes=[("helps", {"budget": 0.5})], memory_budget="min").resolved(
        fake_registry)
    assert [(s.name, o) for s, o in plan] == [("helps", {"budget": 0.5}),
                                               ("keeps_budget", {"budget": "min"})]


def test_a_budget_without_a_pass_that_keeps_it_is_a_config_error():
    registry = PassRegistry([PassSpec("first", _noop, "first")])
    with pytest.raises(ConfigError, match="no pass of the registry keeps a budget"):
        Config(memory_budget=0.5).resolved(registry)


def test_the_training_setup_reaches_the_passes_that_read_it(fake_registry):
    from fxopt.core.training_setup import TrainingSetup
    training = TrainingSetup(outputs="loss")
    records = run_passes(_gm(), Config(passes=["first", "plans"], training=training),
                         fake_registry)
    assert records[1].stats["training"] is training and "training" not in records[0].stats


def test_the_pipeline_names_no_pass():
    """Every decision about a pass travels by its ``PassSpec``: the pipeline's code names none
    of the built-in passes."""
    import inspect

    from fxopt import passes
    from fxopt.rewrite import pipeline
    source = inspect.getsource(pipeline)
    named = [spec.name for spec in passes.REGISTRY if f'"{spec.name}"' in source
             or f"'{spec.name}'" in source]
    assert named == []


def test_run_records_and_numerics(fake_registry, tmp_path):
    gm = _gm()
    x = torch.randn(2, 3)
    expected = gm(x) * 2
    records = run_passes(gm, Config(passes=[("first", {"scale": 3.0}), "double"], dump_dir=tmp_path),
                         fake_registry)
    assert [(r.name, r.modified) for r in records] == [("first", False), ("double", True)]
    assert records[0].stats == {"scale": 3.0}
    assert records[1].nodes_after == records[1].nodes_before + 1
    torch.testing.assert_close(gm(x), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_traced.txt", "01_first.txt",
                                                          "02_double.txt"]
    assert "torch.mul" in (tmp_path / "02_double.txt").read_text()


@pytest.mark.parametrize("bad, message", [
    ("no_provenance", "no meta\\['fxopt_pass'\\]"),
    ("lies", "modified=False but changed"),
    ("crashes", "crashed: RuntimeError: boom"),
    ("type_error", "crashed: TypeError: object of type 'int' has no len"),
    # an analysis error inside a pass is the pass's failure, not the user's input's
    ("refuses", "failed: InputError: Net cannot run on fake tensors"),
])
def test_bad_pass_is_named_with_its_predecessors(fake_registry, bad, message):
    with pytest.raises(PassError, match=message) as info:
        run_passes(_gm(), Config(passes=["first", bad]), fake_registry)
    assert f"pass '{bad}' (after: first)" in str(info.value)


def test_bad_option_is_config_error(fake_registry):
    with pytest.raises(ConfigError, match="bad options"):
        run_passes(_gm(), Config(passes=[("first", {"nonsense": 1})]), fake_registry)


def test_budget_errors_from_a_pass_reach_the_user_as_they_are(fake_registry):
    with pytest.raises(BudgetError, match="cannot be met"):
        run_passes(_gm(), Config(passes=["first", "over_budget"]), fake_registry)
