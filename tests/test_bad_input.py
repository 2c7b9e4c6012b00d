"""Unusual models and inputs: each works (verified equal) or raises a clear fxopt error.

Every case also checks that the user's model comes back exactly as it went in: state_dict values,
the parameter and buffer objects, ``.grad``, module flags and the global RNG state, including
when optimize() fails half-way (a crashing pass, a failed verification, an impossible budget).
"""

from __future__ import annotations

import collections
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from helpers import Snapshot, TiedEmbedding
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxopt
import fxopt.passes as pass_registry
from fxopt.rewrite.pass_base import PassResult

Pair = namedtuple("Pair", "main aux")


def optimize_ok(model: nn.Module, inputs, **kwargs) -> torch.fx.GraphModule:
    """optimize() succeeds, verifies equal, and leaves the user's model untouched."""
    snapshot = Snapshot(model)
    gm = fxopt.optimize(model, inputs, **kwargs)
    snapshot.assert_unchanged()
    assert gm.fxopt_report.verification is None or gm.fxopt_report.verification.ok
    assert list(gm.state_dict()) == list(model.state_dict())
    return gm


def optimize_fails(model: nn.Module, inputs, error: type, *fragments: str, **kwargs) -> str:
    """optimize() raises ``error`` whose text holds every fragment plus a hint; model untouched."""
    snapshot = Snapshot(model) if isinstance(model, nn.Module) else None
    with pytest.raises(error) as info:
        fxopt.optimize(model, inputs, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert info.value.hint, message
    if snapshot:
        snapshot.assert_unchanged()
    return message


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------ what is a model


@pytest.mark.parametrize("bad", [object(), lambda x: x, "resnet18", torch.randn(2)])
def test_non_module_objects_are_input_errors(bad):
    optimize_fails(bad, X, fxopt.InputError, "needs a torch.nn.Module")


def test_model_without_parameters_works():
    class Scale(nn.Module):
        def forward(self, x):
            return torch.relu(x * 2) - 1

    gm = optimize_ok(Scale(), X)
    assert gm.fxopt_report.verification.checked["param_grad"] == 0


def test_meta_device_model_needs_verify_off():
    model, x = mlp().to("meta"), torch.empty(3, 4, device="meta")
    optimize_fails(model, x, fxopt.InputError, "meta device", "verify=False")
    gm = fxopt.optimize(model, x, verify=False)  # rewriting works on fakes
    assert gm.fxopt_report.verification is None


# ------------------------------------------------------------------------------ inputs


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask, scale=2.0):
        return self.lin(x).masked_fill(mask, 0.0) * scale


def test_integer_and_boolean_inputs():
    tokens = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(1))
    optimize_ok(nn.Sequential(nn.Embedding(10, 4), nn.ReLU(), nn.Linear(4, 2)), tokens)
    mask = torch.rand(3, 4, generator=torch.Generator().manual_seed(2)) > 0.5
    gm = optimize_ok(Masked(), (X, mask), measure_memory=True)
    assert gm.fxopt_report.verification.checked["input_grad"] == 1  # only x is differentiable


def test_plain_values_and_left_out_arguments_are_fixed():
    mask = torch.zeros(3, 4, dtype=torch.bool)
    gm = optimize_ok(Masked(), (X, mask, 3.0))
    torch.testing.assert_close(gm(X, mask, 3.0), Masked.forward(gm, X, mask, 3.0))
    with pytest.raises(AssertionError, match="specialized"):
        gm(X, mask, 4.0)  # the optimized module checks it gets the value it was built for
    gm = optimize_ok(Masked(), (X, mask))  # scale left out: its default 2.0 is fixed


def test_tuple_and_dict_positional_inputs_work_end_to_end():
    class TakesPairAndDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, pair, batch):
            a, b = pair
            return self.lin(a) * b + batch["bias"]

    inputs = ((X, X + 1), {"bias": torch.ones(3, 4)})
    gm = optimize_ok(TakesPairAndDict(), inputs, measure_memory=True)
    assert gm.fxopt_report.verification.checked["input_grad"] == 3
    assert gm.fxopt_report.memory_after.train.inputs_bytes == 3 * X.nbytes


def test_a_bare_dict_is_ambiguous_and_the_error_says_how_to_call():
    message = optimize_fails(Masked(), {"x": X, "mask": X > 0}, fxopt.InputError,
                             "given as a dict", "(inputs_dict,)", "example_kwargs")
    assert "Masked.forward" in message


@pytest.mark.parametrize("inputs, fragments", [
    ((X,), ["needs argument 'mask'"]),
    ((X, X > 0, 1.0, 5), ["takes 3 positional argument(s) (x, mask, scale)", "give 4"]),
    ((X, object()), ["example input 1 holds a object"]),
    ((None,), ["must be a tensor or a tuple of tensors"]),
])
def test_wrong_example_inputs_are_input_errors(inputs, fragments):
    optimize_fails(Masked(), inputs, fxopt.InputError, *fragments)


def test_inputs_the_model_cannot_run_on_are_input_errors_naming_the_line():
    optimize_fails(mlp(), torch.randn(3, 5), fxopt.InputError,
                   "does not run on these example inputs",
                   "mat1 and mat2")


# ------------------------------------------------------------------------------ outputs


class Outputs(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "dict":
            return {"logits": y, "features": F.relu(y)}
        if self.kind == "ordered":
            return collections.OrderedDict(out=y)
        if self.kind == "namedtuple":
            return Pair(y, y.sum(1))
        if self.kind == "with_none":
            return y, None
        return None


@pytest.mark.parametrize("kind, expected", [
    ("dict", dict), ("ordered", collections.OrderedDict), ("namedtuple", Pair),
    ("with_none", tuple), ("none", type(None)),
])
def test_outputs_keep_their_container_type(kind, expected):
    gm = optimize_ok(Outputs(kind), X)
    assert type(gm(X)) is expected


# ------------------------------------------------------------------------------ model contents


def test_tied_weights_stay_tied():
    model = TiedEmbedding()
    gm = optimize_ok(model, torch.randint(0, 10, (2, 3)))
    assert gm.head.weight is gm.emb.weight is model.emb.weight


class Tracks(nn.Module):
    def __init__(self, replace: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(4))
        self.replace = replace

    def forward(self, x):
        y = self.lin(x)
        if self.replace:
            self.seen = self.seen + 1
        else:
            self.seen.add_(1)
            with torch.no_grad():
                self.mean.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return y


def test_buffers_updated_in_place_in_forward_work():
    gm = optimize_ok(Tracks(replace=False), X)
    assert gm.fxopt_report.verification.checked["buffer"] == 2


def test_a_buffer_replaced_in_forward_is_a_trace_error_naming_it():
    optimize_fails(Tracks(replace=True), X, fxopt.TraceError, "buffer 'seen'", ".add_(1)")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


def test_a_users_checkpoint_inside_a_submodule_is_kept_as_written():
    model = nn.Sequential(nn.Linear(4, 4), Block(), nn.Linear(4, 2))
    gm = optimize_ok(model, X)
    leaves = {leaf.path: leaf.reason for leaf in gm.fxopt_report.trace.leaves}
    assert list(leaves) == ["1"] and "torch.utils.checkpoint" in leaves["1"]
    assert any(n.op == "call_module" and n.target == "1" for n in gm.graph.nodes)


def test_a_users_checkpoint_in_the_root_forward_is_a_clear_trace_error():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(self.body, x, use_reentrant=False)

    optimize_fails(Root(), X, fxopt.TraceError, "torch.utils.checkpoint",
                   "into a submodule", "memory_budget")


def test_models_with_their_own_in_place_ops_work():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x)
            y += self.b(x)
            y.mul_(0.5)
            return F.relu(y, inplace=True)

    optimize_ok(Residual(), X)


def test_a_model_in_eval_mode_stays_in_eval_and_both_modes_are_kept():
    class DropsInTraining(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return F.dropout(self.bn(self.lin(x)), 0.5, self.training)

    model = DropsInTraining().eval()
    gm = optimize_ok(model, X)
    assert gm.training is False and gm.bn.training is False
    assert gm.fxopt_report.trace.mode_dependent
    with torch.no_grad():
        torch.testing.assert_close(gm(X), model(X), rtol=0, atol=0)


def test_a_frozen_submodule_keeps_its_own_flag():
    model = mlp()
    model[1].eval()  # a frozen BatchNorm inside a model in train mode
    gm = optimize_ok(model, X)
    assert gm.training and not gm.get_submodule("1").training


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)
    gm = optimize_ok(model, X.to(dtype))
    assert gm(X.to(dtype)).dtype == dtype


def test_existing_gradients_are_left_alone():
    model = mlp()
    model(X).sum().backward()
    optimize_ok(model, X)  # Snapshot checks the same .grad objects with the same values


# ------------------------------------------------------------------------ failures half-way


def test_a_crashing_pass_leaves_the_model_untouched(monkeypatch):
    def crash(gm, **options):
        torch.randn(3)  # draws from the global RNG before failing
        for p in gm.parameters():
            p.grad = torch.ones_like(p)
        raise RuntimeError("boom")

    spec = pass_registry.PassSpec("crasher", crash, "crashes")
    monkeypatch.setattr(pass_registry, "REGISTRY", pass_registry.REGISTRY.with_pass(spec))
    model = mlp()
    model[1].eval()
    message = optimize_fails(model, X, fxopt.PassError, "pass 'crasher' crashed", "boom",
                             passes=["crasher"])
    assert "crasher" in message


def test_a_failed_verification_leaves_the_model_untouched(monkeypatch):
    def wrong(gm, **options):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            doubled = gm.graph.call_function(torch.mul, (output.args[0], 2.0))
        doubled.meta["fxopt_pass"] = "wrong"
        output.args = (doubled,)
        fxopt.graph.meta.refresh_meta(gm)
        return PassResult(gm, True, {})

    spec = pass_registry.PassSpec("wrong", wrong, "doubles the output")
    monkeypatch.setattr(pass_registry, "REGISTRY", pass_registry.REGISTRY.with_pass(spec))
    optimize_fails(mlp(), X, fxopt.EquivalenceError, "differs from the original", passes=["wrong"])


def test_an_impossible_budget_leaves_the_model_untouched():
    optimize_fails(mlp(), X, fxopt.BudgetError, "cannot be met", memory_budget=1)


def test_frozen_parameters_stay_frozen_and_get_no_gradient():
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    gm = optimize_ok(model, X)  # Snapshot checks requires_grad is as before
    assert gm.fxopt_report.verification.checked["param_grad"] == 6  # frozen: None on both sides


def test_no_fake_tensor_is_left_behind_on_the_optimized_module():
    """The fake-tensor analyses swap every parameter for a stand-in and back; an LSTM also
    keeps its weights in a plain list (``_flat_weights``), which must be rebuilt on the way out."""
    from torch._subclasses.fake_tensor import FakeTensor

    model = nn.Sequential(nn.LSTM(4, 8, batch_first=True))
    gm = optimize_ok(model, torch.randn(2, 5, 4), verify=False)
    for module in [*gm.modules(), *model.modules()]:
        held = [v for value in vars(module).values()
                for v in (value if isinstance(value, list) else [value])]
        assert not any(isinstance(v, FakeTensor) for v in held), type(module).__name__
