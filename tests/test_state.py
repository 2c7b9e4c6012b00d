"""fxopt.core.state: preserved_state / preserved_rng put everything back, even on an error."""

import pytest
import torch
from torch import nn

from fxopt.core.state import preserved_rng, preserved_state


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count += 1
        return self.head(self.drop(self.bn(self.lin(x))))


class Boom(Exception):
    pass


def _state(model: nn.Module) -> dict:
    return {
        "params": {n: (p, p.detach().clone()) for n, p in model.named_parameters()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "grad_values": {n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()},
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers()},
        "flags": {n: m.training for n, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def _assert_restored(model: nn.Module, before: dict) -> None:
    params = dict(model.named_parameters())
    assert list(params) == list(before["params"])
    for name, (obj, value) in before["params"].items():
        assert params[name] is obj, f"parameter {name} replaced"
        assert torch.equal(obj, value)
        assert obj.grad is before["grads"][name], f"{name}.grad replaced"
        if obj.grad is not None:
            assert torch.equal(obj.grad, before["grad_values"][name]), f"{name}.grad changed"
    buffers = dict(model.named_buffers())
    assert list(buffers) == list(before["buffers"])
    for name, (obj, value) in before["buffers"].items():
        assert buffers[name] is obj, f"buffer {name} replaced"
        assert torch.equal(obj, value), f"buffer {name} changed"
    assert {n: m.training for n, m in model.named_modules()} == before["flags"]
    assert torch.equal(torch.get_rng_state(), before["rng"])


def _train_and_mess_up(model: nn.Module) -> None:
    """What a training step and a careless caller do to a model."""
    for p in model.parameters():
        p.grad = None
    model.train()
    model(torch.randn(5, 4)).sum().backward()            # grads, BN stats, counter, RNG
    assert model.lin.weight.grad is not None and int(model.count) == 1
    model.bn.eval()                                       # flags
    model.head.weight = nn.Parameter(torch.zeros(2, 3))   # a parameter object replaced
    model.bn.running_mean = torch.full((3,), 7.0)         # a buffer object replaced
    model.count = model.count + 1                          # ... the way a forward might
    torch.rand(10)                                        # RNG drawn again


@pytest.mark.parametrize("raises", [False, True])
def test_everything_is_restored_after_a_training_step(raises):
    torch.manual_seed(0)
    model = Net().eval()
    model.lin.weight.grad = torch.ones(3, 4)  # a grad the user had: the same object comes back
    before = _state(model)
    if raises:
        with pytest.raises(Boom):
            with preserved_state(model):
                _train_and_mess_up(model)
                raise Boom
    else:
        with preserved_state(model):
            _train_and_mess_up(model)
    _assert_restored(model, before)
    assert model.lin.bias.grad is None


def test_the_check_itself_sees_what_is_not_restored():
    model = Net()
    before = _state(model)
    _train_and_mess_up(model)
    with pytest.raises(AssertionError):
        _assert_restored(model, before)


def test_shared_parameters_and_several_modules():
    """Two modules sharing a Parameter (an optimized GraphModule and the user's model): each
    tensor is snapshotted once, and both come back."""
    torch.manual_seed(1)
    first = Net()
    second = nn.Sequential(first.lin, nn.BatchNorm1d(3))
    before = [_state(first), _state(second)]
    with pytest.raises(Boom), preserved_state(first, second):
        second(torch.randn(6, 4)).sum().backward()
        first(torch.randn(6, 4)).sum().backward()
        raise Boom
    _assert_restored(first, before[0])
    _assert_restored(second, before[1])


def test_only_the_modules_named_are_restored():
    inside, outside = Net(), Net()
    with preserved_state(inside):
        for model in (inside, outside):
            model.train()
            model(torch.randn(3, 4)).sum().backward()
    assert inside.lin.weight.grad is None and int(inside.count) == 0
    assert outside.lin.weight.grad is not None and int(outside.count) == 1


def test_preserved_rng_restores_the_stream_even_on_error():
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with pytest.raises(Boom), preserved_rng():
        torch.rand(100)
        torch.manual_seed(123)
        raise Boom
    assert torch.equal(torch.rand(4), expected)


def test_grad_values_survive_a_backward_that_accumulates_into_them():
    model = Net()
    model(torch.randn(5, 4)).sum().backward()
    before = _state(model)
    with preserved_state(model):
        model(torch.randn(5, 4)).sum().backward()
    _assert_restored(model, before)
