"""passes.inplace_activations: golden graphs for what must and must not become in-place."""

import pytest
import torch
import torch.nn.functional as F
from helpers import check_pass
from torch import nn

from fxopt.capture.trace import trace
from passes.inplace_activations import inplace_activations


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
    import models_zoo

    model, inputs = models_zoo.build(name)
    gm, result = check_pass(model, inputs, inplace_activations, expect_modified=True)
    assert result.stats["rewritten"] >= 1
    assert "inplace=True" in gm.code or "relu_" in gm.code
    print(name, result.stats["rewritten"], "rewritten;", len(result.stats["skipped"]), "skipped")


def test_torchvision_resnet_already_inplace_is_unchanged():
    import models_zoo

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
