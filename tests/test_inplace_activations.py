"""passes.inplace_activations: golden graphs for what must and must not become in-place."""

import pytest
import torch
import torch.nn.functional as F
from helpers import check_pass
from torch import nn

from fxopt.capture.export_frontend import capture_with_export
from fxopt.capture.trace import trace
from fxopt.graph.train_eval import eval_graph
from fxopt.core.tensors import storage_key
from fxopt.verify import verify
from fxopt.passes.inplace_activations import _TORCH_TO_INPLACE, PASS_NAME, inplace_activations


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def test_module_relu_after_batchnorm_becomes_functional_inplace():
    model = ConvBnRelu()
    gm, result = check_pass(
        model, (torch.randn(2, 3, 6, 6),), inplace_activations,
        golden_before="""
            x = input
            conv = conv:Conv2d(x)
            bn = bn:BatchNorm2d(conv)
            act = act:ReLU(bn)
            return act
        """,
        golden_after="""
            x = input
            conv = conv:Conv2d(x)
            bn = bn:BatchNorm2d(conv)
            relu = relu(bn, inplace=True)
            return relu
        """,
    )
    assert result.stats["rewritten"] == 1
    assert model.act.inplace is False and gm.act.inplace is False  # no module was flipped


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = self.b(h).relu()
        return F.leaky_relu(self.c(h), 0.2)


def test_functional_method_and_torch_forms():
    check_pass(
        Functional(), (torch.randn(3, 4),), inplace_activations,
        golden_after="""
            x = input
            a = a:Linear(x)
            relu_ = relu_(a)
            b = b:Linear(relu_)
            relu__1 = .relu_(b)
            c = c:Linear(relu__1)
            leaky_relu_1 = leaky_relu(c, negative_slope=0.2, inplace=True)
            return leaky_relu_1
        """,
    )


class Unsafe(nn.Module):
    """Every activation here must stay out-of-place in train mode."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        graph_input = F.relu(x)                   # input is a graph input
        y = self.lin(graph_input)
        used_twice = self.act(y) * y              # input used again afterwards
        s = torch.sigmoid(used_twice)
        after_sigmoid = F.relu(s)                 # sigmoid saves its output for backward
        z = self.lin(after_sigmoid)
        residual = F.relu(z) + z                  # residual add reads the input later
        view = residual.view(-1)
        through_view = F.relu(view) + residual.sum()  # base of the view read later
        silu = F.silu(self.lin(x))                # silu_ would save a copy: no saving
        leaky = F.leaky_relu(self.lin(x), -0.5)   # negative slope: in-place cannot backward
        return through_view.sum() + silu.sum() + leaky.sum()


def test_unsafe_sites_are_left_alone_with_reasons():
    gm, result = check_pass(Unsafe(), (torch.randn(3, 4),), inplace_activations,
                            expect_modified=False)
    reasons = result.stats["skipped"]
    assert reasons["relu"] == "input is a graph input or parameter"
    assert reasons["act"].startswith("input is used later")
    assert reasons["relu_1"].startswith("backward of sigmoid needs the input")
    assert reasons["relu_2"].startswith("input is used later")
    assert reasons["relu_3"].startswith("input is used later")
    assert "copy of the input" in reasons["silu"]
    assert "copy of the input" in reasons["leaky_relu"]


def test_eval_mode_option_is_looser():
    model = Unsafe()
    gm = trace(model, (torch.randn(3, 4),))
    result = inplace_activations(gm, train=False)
    assert result.stats["rewritten"] == 3  # after the sigmoid, silu, leaky: autograd is off
    assert set(result.stats["skipped"]) == {"relu", "act", "relu_2", "relu_3"}
    model.eval(), gm.eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_shared_relu_module_decided_per_call_site():
    class SharedRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.relu = nn.ReLU()

        def forward(self, x):
            h = self.relu(self.a(x))
            return self.relu(self.b(h) + x)

    model = SharedRelu()
    gm, result = check_pass(model, (torch.randn(2, 4),), inplace_activations)
    assert result.stats["rewritten"] == 2
    assert model.relu.inplace is False and gm.relu.inplace is False


def test_model_without_activations_is_unchanged():
    check_pass(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), (torch.randn(2, 3),),
               inplace_activations, expect_modified=False)


def test_module_with_hook_is_left_alone():
    model = ConvBnRelu()
    model.act.register_forward_hook(lambda m, i, o: None)
    check_pass(model, (torch.randn(2, 3, 6, 6),), inplace_activations, expect_modified=False)


class LinearReluLinear(nn.Module):
    """Without hooks, ``act`` becomes ``relu(lin, inplace=True)``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.act(self.lin(x)))


_SEEN = lambda seen: lambda value: seen.append(  # noqa: E731
    None if value is None else value.detach().clone())  # grad_in[0] of a layer on the input

# name -> registers a hook on a module that records what it sees into the list it is given
_HOOKS = {
    "forward_pre": lambda m, seen: m.register_forward_pre_hook(
        lambda mod, args: _SEEN(seen)(args[0])),
    "forward_pre_with_kwargs": lambda m, seen: m.register_forward_pre_hook(
        lambda mod, args, kwargs: _SEEN(seen)(args[0]), with_kwargs=True),
    "forward": lambda m, seen: m.register_forward_hook(
        lambda mod, args, out: _SEEN(seen)(out)),
    "forward_always_call": lambda m, seen: m.register_forward_hook(
        lambda mod, args, out: _SEEN(seen)(out), always_call=True),
    "full_backward_pre": lambda m, seen: m.register_full_backward_pre_hook(
        lambda mod, grad_out: _SEEN(seen)(grad_out[0])),
    "full_backward": lambda m, seen: m.register_full_backward_hook(
        lambda mod, grad_in, grad_out: _SEEN(seen)(grad_in[0])),
}


def _step_seen(module: nn.Module, x: torch.Tensor, seen: list) -> list:
    seen.clear()
    module(x).sum().backward()
    return list(seen)


def _same_seen(before: list, after: list) -> bool:
    return len(before) == len(after) and all(
        a is b is None or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(before, after))


def test_hookless_reference_model_is_rewritten():
    gm, _ = check_pass(LinearReluLinear(), (torch.randn(3, 4),), inplace_activations)
    assert "inplace = True" in gm.code


@pytest.mark.parametrize("kind", sorted(_HOOKS))
def test_activation_with_hook_keeps_its_module_call_and_hook(kind):
    torch.manual_seed(0)
    model, seen, x = LinearReluLinear(), [], torch.randn(3, 4)
    _HOOKS[kind](model.act, seen)
    expected = _step_seen(model, x, seen)
    assert len(expected) == 1
    gm, result = check_pass(model, (x,), inplace_activations, expect_modified=False,
                            golden_after="""
                                x = input
                                lin = lin:Linear(x)
                                act = act:ReLU(lin)
                                out = out:Linear(act)
                                return out
                            """)
    assert result.stats["skipped"]["act"].startswith("module has ")
    model.zero_grad()
    assert _same_seen(expected, _step_seen(gm, x, seen))


@pytest.mark.parametrize("kind", sorted(_HOOKS))
def test_activation_does_not_overwrite_what_a_producers_hook_saw(kind):
    # A forward hook keeping the Linear's output (feature extraction) would find it overwritten
    # by ReLU; a full backward hook makes autograd refuse the in-place write outright.
    torch.manual_seed(0)
    model, seen, x = LinearReluLinear(), [], torch.randn(3, 4, requires_grad=True)
    kept = []
    _HOOKS[kind](model.lin, seen)
    model.lin.register_forward_hook(lambda mod, args, out: kept.append(out))
    expected = _step_seen(model, x, seen)
    kept_expected = [t.detach().clone() for t in kept]
    gm, result = check_pass(model, (x,), inplace_activations, expect_modified=False)
    assert result.stats["skipped"]["act"] == "input is seen by the hooks of lin"
    kept.clear()
    assert _same_seen(expected, _step_seen(gm, x, seen))
    assert _same_seen(kept_expected, [t.detach() for t in kept])


def test_activation_does_not_overwrite_an_input_a_hook_saw_earlier():
    class Tap(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.probe = nn.Identity()
            self.act = nn.ReLU()

        def forward(self, x):
            h = self.lin(x)
            self.probe(h)  # its result is unused; its pre-hook keeps h
            return self.act(h)

    model, kept = Tap(), []
    model.probe.register_forward_pre_hook(lambda mod, args: kept.append(args[0]))
    x = torch.randn(3, 4)
    model(x)
    expected = [t.detach().clone() for t in kept]
    gm, result = check_pass(model, (x,), inplace_activations, expect_modified=False)
    assert result.stats["skipped"]["act"] == "input is seen by the hooks of probe"
    kept.clear()
    gm(x)
    assert _same_seen(expected, [t.detach() for t in kept])


def test_process_wide_module_hook_does_not_stop_the_rewrite():
    # Documented: global hooks belong to no module; a rewritten site is no longer a module call.
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        gm = trace(LinearReluLinear(), (torch.randn(3, 4),))
        assert inplace_activations(gm).stats["rewritten"] == 1
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["odd_channel_cnn", "unet", "mnist_net", "mlp"])
def test_zoo_models_verify_after_pass(name):
    from fxopt import models_zoo

    model, inputs = models_zoo.build(name)
    gm, result = check_pass(model, inputs, inplace_activations, expect_modified=True)
    assert result.stats["rewritten"] >= 1
    assert "inplace=True" in gm.code or "relu_" in gm.code
    print(name, result.stats["rewritten"], "rewritten;", len(result.stats["skipped"]), "skipped")


def test_torchvision_resnet_already_inplace_is_unchanged():
    from fxopt import models_zoo

    model, inputs = models_zoo.build("resnet18")
    gm = trace(model, inputs)
    assert inplace_activations(gm).modified is False


def test_the_pass_draws_no_random_numbers_and_keeps_no_state_between_runs():
    """Which in-place forms are safe is asked of autograd on a fixed tensor, per run: the global
    RNG stream is the same with or without the pass, and a second run decides the same way."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.SiLU())
    torch.manual_seed(7)
    expected = torch.rand(3)
    results = []
    for _ in range(2):
        gm = trace(model, torch.randn(2, 4))
        torch.manual_seed(7)
        results.append(inplace_activations(gm).stats["rewritten"])
        assert torch.equal(torch.rand(3), expected)
    assert results[0] == results[1] and results[0]


# -- ATen graphs (capture="export"): aten.<act>.default -> aten.<act>_.default


aten = torch.ops.aten


def check_export_pass(model, inputs, *, train=True, golden_before=None, golden_after=None,
                      expect_modified=True):
    """check_pass on a torch.export capture, plus: every rewritten site is marked, listed in the
    stats, and its meta aliases its input's storage."""
    gm, result = check_pass(model, inputs, inplace_activations, options={"train": train},
                            golden_before=golden_before, golden_after=golden_after,
                            expect_modified=expect_modified, capture="export", numerics=train)
    for node in gm.graph.nodes:
        if node.meta.get("fxopt_pass") == PASS_NAME:
            assert node.name in result.stats["sites"]
            assert storage_key(node.meta["val"]) == storage_key(node.args[0].meta["val"])
    return gm, result


class AtenActs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        h = F.relu(self.a(x))
        h = F.leaky_relu(self.b(h), 0.2)
        h = F.elu(self.c(h))
        return F.silu(self.d(h))


def test_aten_activations_become_inplace_overloads():
    gm, result = check_export_pass(
        AtenActs(), (torch.randn(3, 4),),
        golden_before="""
            x = input
            a_weight = @a.weight()
            a_bias = @a.bias()
            b_weight = @b.weight()
            b_bias = @b.bias()
            c_weight = @c.weight()
            c_bias = @c.bias()
            d_weight = @d.weight()
            d_bias = @d.bias()
            _fxopt_input_guard = @_fxopt_input_guard()
            guard_inputs = guard_inputs(_fxopt_input_guard, x, state=[a_weight, a_bias, b_weight, b_bias, c_weight, c_bias, d_weight, d_bias])
            linear = linear.default(x, a_weight, a_bias)
            relu = relu.default(linear)
            linear_1 = linear.default(relu, b_weight, b_bias)
            leaky_relu = leaky_relu.default(linear_1, 0.2)
            linear_2 = linear.default(leaky_relu, c_weight, c_bias)
            elu = elu.default(linear_2, 1.0)
            linear_3 = linear.default(elu, d_weight, d_bias)
            silu = silu.default(linear_3)
            return silu
        """,
        golden_after="""
            x = input
            a_weight = @a.weight()
            a_bias = @a.bias()
            b_weight = @b.weight()
            b_bias = @b.bias()
            c_weight = @c.weight()
            c_bias = @c.bias()
            d_weight = @d.weight()
            d_bias = @d.bias()
            _fxopt_input_guard = @_fxopt_input_guard()
            guard_inputs = guard_inputs(_fxopt_input_guard, x, state=[a_weight, a_bias, b_weight, b_bias, c_weight, c_bias, d_weight, d_bias])
            linear = linear.default(x, a_weight, a_bias)
            relu_ = relu_.default(linear)
            linear_1 = linear.default(relu_, b_weight, b_bias)
            leaky_relu_ = leaky_relu_.default(linear_1, 0.2)
            linear_2 = linear.default(leaky_relu_, c_weight, c_bias)
            elu_ = elu_.default(linear_2, 1.0)
            linear_3 = linear.default(elu_, d_weight, d_bias)
            silu = silu.default(linear_3)
            return silu
        """)
    assert result.stats["sites"] == ["relu_", "leaky_relu_", "elu_"]
    assert result.stats["skipped"] == {
        "silu": "in-place backward would save a copy of the input (no memory saved)"}
    targets = {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert targets["relu_"] is aten.relu_.default and targets["elu_"] is aten.elu_.default


def test_aten_table_maps_each_functional_overload_to_an_inplace_one_with_its_arguments():
    table = {k: v for k, v in _TORCH_TO_INPLACE.items() if hasattr(k, "overloadpacket")}
    assert {k.overloadpacket.__name__ for k in table} == {
        "relu", "relu6", "leaky_relu", "hardtanh", "elu", "selu", "celu", "silu", "hardswish",
        "hardsigmoid", "mish", "gelu"}
    for functional, inplace in table.items():
        assert inplace.overloadpacket.__name__ == functional.overloadpacket.__name__ + "_"
        schema, inplace_schema = functional._schema, inplace._schema
        assert [(a.name, a.kwarg_only) for a in schema.arguments] == [
            (a.name, a.kwarg_only) for a in inplace_schema.arguments]
        assert inplace_schema.arguments[0].alias_info.is_write  # Tensor(a!) self


class EveryAtenActivation(nn.Module):
    """One site per table entry (and per option autograd answers differently for)."""

    ACTS = {  # node name in the export graph -> (activation, rewritten in train mode)
        "relu": (F.relu, True),
        "relu6": (F.relu6, False),
        "leaky_relu": (lambda h: F.leaky_relu(h, 0.2), True),
        "leaky_relu_1": (lambda h: F.leaky_relu(h, -0.5), False),  # negative slope
        "hardtanh": (lambda h: F.hardtanh(h, -0.5, 0.5), False),
        "elu": (F.elu, True),
        "elu_1": (lambda h: F.elu(h, -1.0), False),  # negative alpha
        "selu": (F.selu, True),
        "celu": (lambda h: F.celu(h, 0.5), True),
        "silu": (F.silu, False),
        "hardswish": (F.hardswish, False),
        "hardsigmoid": (F.hardsigmoid, False),
        "mish": (F.mish, False),
        "gelu": (F.gelu, False),
        "gelu_1": (lambda h: F.gelu(h, approximate="tanh"), False),
    }

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 4) for _ in self.ACTS)

    def forward(self, x):
        for lin, (act, _) in zip(self.lins, self.ACTS.values()):
            x = act(lin(x))
        return x


def test_every_aten_activation_as_autograd_decides_in_train_mode():
    """What autograd says of each in-place form
    (``fxopt.planning.inplace.inplace_backward_saves_only_result``):
    relu_, leaky_relu_(slope >= 0), elu_(alpha >= 0), selu_ and celu_ save only their result;
    relu6_, hardtanh_, silu_, hardswish_, hardsigmoid_, mish_ and gelu_ save a copy of their
    input; leaky_relu_/elu_ with a negative slope/alpha cannot run backward."""
    torch.manual_seed(0)
    model = EveryAtenActivation()
    gm, result = check_export_pass(model, (torch.randn(3, 4),))
    acts = EveryAtenActivation.ACTS
    assert result.stats["rewritten"] == sum(ok for _, ok in acts.values())
    assert set(result.stats["skipped"]) == {name for name, (_, ok) in acts.items() if not ok}
    assert all("copy of the input" in why for why in result.stats["skipped"].values())
    inplace = [n.target for n in gm.graph.nodes if n.meta.get("fxopt_pass") == PASS_NAME]
    assert inplace == [aten.relu_.default, aten.leaky_relu_.default, aten.elu_.default,
                       aten.selu_.default, aten.celu_.default]


def test_every_aten_activation_in_eval_mode():
    torch.manual_seed(0)
    model, x = EveryAtenActivation(), torch.randn(3, 4)
    gm, result = check_export_pass(model, (x,), train=False)
    assert result.stats["rewritten"] == len(EveryAtenActivation.ACTS)
    assert result.stats["skipped"] == {}
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    assert last.target is aten.gelu_.default and last.kwargs == {"approximate": "tanh"}
    model.eval(), gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


class AtenUnsafe(nn.Module):
    """Every activation here must stay out-of-place in train mode."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        graph_input = F.relu(x)                        # relu: a graph input
        param = torch.relu(self.w)                     # relu_1: a parameter
        param_view = F.relu(self.w.t())                # relu_2: a view of a parameter
        input_view = F.relu(x.view(-1))                # relu_3: a view of a graph input
        y = self.lin(graph_input) @ (param + param_view)
        used_twice = F.relu(y) * y                     # relu_4: its input is read later
        after_sigmoid = F.relu(torch.sigmoid(used_twice))  # relu_5: sigmoid saved its output
        z = self.lin(after_sigmoid)
        scaled = z * self.scale                        # mul_1 saves z for scale's gradient
        after_mul = F.relu(z)                          # relu_6
        through_view = F.relu(after_mul.view(-1)) + after_mul.sum()  # relu_7: base read later
        h = self.lin(x)
        acts = (F.silu(h + 1), F.gelu(h + 2), F.leaky_relu(h + 3, -0.5), F.elu(h + 4, -1.0))
        return (through_view.sum() + scaled.sum() + input_view.sum()
                + sum(a.sum() for a in acts))


def test_unsafe_aten_sites_are_left_alone_with_reasons():
    _, result = check_export_pass(AtenUnsafe(), (torch.randn(3, 4),), expect_modified=False)
    copy = "in-place backward would save a copy of the input (no memory saved)"
    assert result.stats["skipped"] == {
        "relu": "input is a graph input or parameter",
        "relu_1": "input is a graph input or parameter",
        "relu_2": "input is a view of a graph input or parameter",
        "relu_3": "input is a view of a graph input or parameter",
        "relu_4": "input is used later by mul",
        "relu_5": "backward of sigmoid needs the input",
        "relu_6": "backward of mul_1 needs the input",
        "relu_7": "input is used later by sum_1",
        "silu": copy, "gelu": copy, "leaky_relu": copy, "elu": copy,
    }


def test_unsafe_aten_sites_in_eval_mode():
    torch.manual_seed(0)
    model, x = AtenUnsafe(), torch.randn(3, 4)
    gm, result = check_export_pass(model, (x,), train=False)
    # relu_5, relu_6 and the four of the last line; relu_7 reads a view of relu_6's result,
    # which relu_6 now writes into z, whose base sum_1 reads later
    assert result.stats["rewritten"] == 6
    assert set(result.stats["skipped"]) == {f"relu{s}" for s in ("", "_1", "_2", "_3", "_4", "_7")}
    assert result.stats["skipped"]["relu_7"] == "input is used later by sum_1"
    model.eval(), gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


class ViewOfRewritten(nn.Module):
    """After ``a`` becomes ``relu_(lin)``, a view of ``a`` is a view of ``lin``'s storage."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        a = F.relu(self.lin(x))
        b = F.selu(a.view(-1))  # selu is not the identity on a >= 0: overwriting a shows
        return b.sum() + (a * 3).sum()


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("train", [True, False])
def test_a_view_of_a_rewritten_result_keeps_its_base_readers(capture, train):
    torch.manual_seed(0)
    model, x = ViewOfRewritten(), torch.randn(3, 4)
    gm = trace(model, (x,)) if capture == "fx" else capture_with_export(model, (x,))
    result = inplace_activations(gm, train=train)
    assert result.stats["rewritten"] == 1
    assert result.stats["skipped"] == {"selu": "input is used later by mul"}
    if train:
        assert verify(model, gm, (x,)).ok
    model.eval(), gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_options_computed_in_the_graph_are_skipped_in_train_mode():
    class SlopeFromShape(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return F.leaky_relu(self.lin(x), x.size(1) / 100)

    gm, result = check_pass(SlopeFromShape(), (torch.randn(3, 4),), inplace_activations,
                            expect_modified=False)
    assert result.stats["skipped"] == {
        "leaky_relu": "its options are computed in the graph: autograd cannot be asked"}


class ReluDropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return self.b(self.drop(F.relu(self.a(x))))


def test_mode_dependent_export_graph_rewrites_the_train_graph_only():
    torch.manual_seed(0)
    model, x = ReluDropoutMLP(), torch.randn(5, 8)
    gm, result = check_export_pass(model, (x,))
    assert result.stats["sites"] == ["relu_"]
    eval_targets = [n.target for n in eval_graph(gm).nodes]
    assert aten.relu.default in eval_targets and aten.relu_.default not in eval_targets


def test_optimize_with_export_capture_rewrites_a_relu_mlp():
    import fxopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    x = torch.randn(5, 8)
    gm = fxopt.optimize(model, x, capture="export")
    report = gm.fxopt_report
    assert report.trace.frontend == "export"
    record = next(r for r in report.passes if r.name == "inplace_activations")
    assert record.modified and record.stats["rewritten"] == 2, record.stats
    assert report.verification is not None and report.verification.ok
    assert gm.code.count("torch.ops.aten.relu_.default(") == 2
    torch.testing.assert_close(gm(x), model(x))


def test_the_decisions_are_planning_s_and_the_pass_only_applies_them():
    """``fxopt.planning.inplace`` decides (asked here without the pass); the pass edits."""
    from fxopt.planning.inplace import InplacePlanner, inplace_backward_saves_only_result

    assert inplace_backward_saves_only_result(aten.relu_.default, (), ())
    assert not inplace_backward_saves_only_result(aten.silu_.default, (), ())
    assert not inplace_backward_saves_only_result(aten.leaky_relu_.default, (-0.1,), ())

    class Net(nn.Module):
        def forward(self, x):
            y = x * 2
            return torch.relu(y), torch.relu(x)

    gm = trace(Net(), torch.randn(3))
    nodes = {n.name: n for n in gm.graph.nodes}
    planner = InplacePlanner(gm, train=True)
    relu_form = (torch.relu_, (), ())
    assert planner.why_not(nodes["relu"], nodes["mul"], relu_form) is None
    assert planner.why_not(nodes["relu_1"], nodes["x"], relu_form) == (
        "input is a graph input or parameter")

