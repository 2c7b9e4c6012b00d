"""trace(): leaf fallback, errors, meta on fake tensors, and the user's model left untouched."""

import operator

import pytest
import torch
import torch.nn.functional as F
from helpers import TiedEmbedding
from torch import nn

from fxopt.capture.trace import trace
from fxopt.core.errors import InputError, TraceError
from fxopt.core.modules import structural_copy


class DataDependentGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace this
            return self.proj(x)
        return -self.proj(x)


class CountsRows(nn.Module):
    def forward(self, x):
        return x * int(x.shape[0] if isinstance(x, torch.Tensor) else x.size(0))


class IteratesProxy(nn.Module):
    def forward(self, x):
        return torch.stack([row * 2 for row in x])  # iteration over a proxy


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = DataDependentGate()
        self.iterates = IteratesProxy()
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        y = F.relu(self.inp(x)) + torch.ones(4)
        return self.drop(self.bn(self.iterates(self.gate(y))))


class RootFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.mean() > 0:
            return self.lin(x)
        return x


def test_leaf_fallback_innermost_first_and_outputs_equal():
    model, x = Net(), torch.randn(3, 4)
    gm = trace(model, (x,))
    leaves = {leaf.path: leaf for leaf in gm.meta["fxopt_trace"].leaves}
    assert set(leaves) == {"gate", "iterates"}
    assert "control flow" in leaves["gate"].reason
    assert "x.sum() > 0" in leaves["gate"].reason  # the user's source line
    assert leaves["gate"].module_type == "DataDependentGate"
    targets = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert {"gate", "iterates"} <= targets and "gate.proj" not in targets
    gm.eval(), model.eval()
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_the_traces_of_forward_are_counted_failed_ones_included():
    """Each attempt traces train mode, then eval mode; one that fails in a submodule (which then
    becomes a leaf) counts its one trace."""
    assert trace(TwoLayerBlock(), (torch.randn(2, 4),)).meta["fxopt_trace"].traces == 2
    assert trace(Net(), (torch.randn(3, 4),)).meta["fxopt_trace"].traces == 1 + 1 + 2


def test_root_failure_raises_trace_error_with_where_and_hint():
    with pytest.raises(TraceError) as info:
        trace(RootFails(), torch.randn(2, 4))
    message = str(info.value)
    assert "RootFails" in message and "<root>" in message
    assert "x.mean() > 0" in message  # source line
    assert "what to do" in message


def test_forced_leaf_modules():
    gm = trace(Net(), torch.randn(3, 4), leaf_modules=("gate", "iterates"))
    assert gm.meta["fxopt_trace"].leaves == []
    assert "gate" in {n.target for n in gm.graph.nodes if n.op == "call_module"}


def test_user_model_untouched_and_parameters_shared():
    model, x = Net(), torch.randn(3, 4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = {name: set(m.__dict__) for name, m in model.named_modules()}
    rng = torch.get_rng_state()
    gm = trace(model, x)
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == attrs
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())  # meta propagation draws no random numbers
    assert gm.inp.weight is model.inp.weight and gm.bn.running_mean is model.bn.running_mean
    assert gm.inp is not model.inp  # module objects are copies: passes may flip flags freely
    gm.bn.momentum = 0.9
    assert model.bn.momentum == 0.1


def test_state_dict_keys_order_and_shapes_identical_including_unused_params():
    model = Net()
    gm = trace(model, torch.randn(3, 4))
    assert [(k, v.shape) for k, v in gm.state_dict().items()] == [
        (k, v.shape) for k, v in model.state_dict().items()
    ]
    assert [id(p) for p in gm.parameters()] == [id(p) for p in model.parameters()]
    gm.load_state_dict(model.state_dict())
    model.load_state_dict(gm.state_dict())


def test_meta_val_on_every_node_is_fake_with_right_shape():
    from torch._subclasses.fake_tensor import FakeTensor

    gm = trace(Net(), torch.randn(3, 4))
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        assert isinstance(node.meta["val"], FakeTensor), node.name
        assert node.meta["val"].shape[-1] == 4 or node.op == "get_attr"
    gate = next(n for n in gm.graph.nodes if n.target == "gate")
    assert gate.meta["fxopt_meta_source"] == "real"  # data-dependent leaf ran once for real
    assert tuple(gate.meta["val"].shape) == (3, 4)


def test_tied_weights_stay_tied():
    model = TiedEmbedding()
    gm = trace(model, torch.randint(0, 10, (2, 3)))
    assert gm.head.weight is gm.emb.weight is model.emb.weight
    assert list(gm.state_dict()) == list(model.state_dict())


def test_structural_copy_preserves_module_sharing():
    shared = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), shared, nn.Linear(2, 2), shared)
    copy = structural_copy(model)
    assert copy[1] is copy[3] and copy[1] is not shared


class TwoLayerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


def test_submodule_with_hooks_stays_a_call_so_its_hooks_fire_when_the_module_runs():
    model = nn.Sequential(TwoLayerBlock(), TwoLayerBlock(), nn.Linear(4, 2))
    calls = []
    model[0].register_forward_hook(lambda mod, args, out: calls.append("forward"))
    model[0].register_full_backward_pre_hook(lambda mod, grad_out: calls.append("backward"))
    x = torch.randn(3, 4, requires_grad=True)
    gm = trace(model, (x,))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1.lin", "2"]
    leaves = gm.meta["fxopt_trace"].leaves
    assert [(leaf.path, leaf.module_type) for leaf in leaves] == [("0", "TwoLayerBlock")]
    assert leaves[0].reason == "has forward hooks and backward pre-hooks: kept as a call so they run"
    calls.clear()
    gm(x).sum().backward()
    assert calls == ["forward", "backward"]


def test_root_hooks_fire_on_the_traced_module():
    model, calls = nn.Sequential(nn.Linear(4, 2)), []
    model.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    model.register_forward_hook(lambda mod, args, out: calls.append(mod))
    x = torch.randn(3, 4)
    gm = trace(model, (x,))
    calls.clear()
    assert torch.equal(gm(x), model(x))
    assert calls == [gm, model]


def test_hooks_registered_on_the_traced_module_do_not_reach_the_users_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gm = trace(model, (torch.randn(3, 4),))
    gm.get_submodule("1").register_full_backward_pre_hook(lambda mod, grad_out: None)
    gm.register_forward_hook(lambda mod, args, out: None)
    assert not model[1]._backward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("bad_model", [object(), lambda x: x, "resnet"])
def test_non_module_is_input_error(bad_model):
    with pytest.raises(InputError, match="torch.nn.Module"):
        trace(bad_model, torch.randn(2))


def test_non_tensor_inputs_are_input_error():
    with pytest.raises(InputError, match="tensor"):
        trace(nn.Linear(2, 2), ([1.0, 2.0],))


# ---------------------------------------------------------------- both modes, outputs, state


class StochasticBlock(nn.Module):
    """Python code that reads self.training: frozen in whichever mode fx traces it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            y = y + F.dropout(y, 0.5, True)
        return y


def test_mode_dependent_forward_keeps_an_eval_graph():
    from fxopt.graph.train_eval import has_eval_graph

    model, x = StochasticBlock(), torch.randn(3, 4)
    gm = trace(model, x)
    assert gm.meta["fxopt_trace"].mode_dependent and has_eval_graph(gm)
    assert "dropout" in gm.code  # the graph passes rewrite is the train-mode one
    gm.eval(), model.eval()
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    gm.train(), model.train()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        expected = model(x)
        torch.manual_seed(0)
        torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)
    assert not trace(nn.Linear(4, 4), x).meta["fxopt_trace"].mode_dependent


class DropsWhatItIsTold(nn.Module):
    """``F.dropout(y, self.p, self.training)`` (or ``torch.dropout``, its namespace spelling): fx
    records the flag as a constant of each trace."""

    def __init__(self, p: float, dropout=F.dropout):
        super().__init__()
        self.lin, self.p, self.dropout = nn.Linear(4, 4), p, dropout

    def forward(self, x):
        return self.dropout(self.lin(x), self.p, self.training)


@pytest.mark.parametrize("dropout", [F.dropout, torch.dropout], ids=["F.dropout", "torch.dropout"])
def test_a_dropout_of_p_0_does_not_make_a_model_mode_dependent(dropout):
    """dropout(y, 0.0, True) and dropout(y, 0.0, False) both give back y: one graph serves
    both modes. At p 0.5 they differ, and the eval-mode graph stays."""
    from fxopt.graph.train_eval import has_eval_graph

    x = torch.randn(3, 4)
    model = DropsWhatItIsTold(0.0, dropout)
    gm = trace(model, x)
    assert not gm.meta["fxopt_trace"].mode_dependent and not has_eval_graph(gm)
    gm.eval(), model.eval()
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    assert trace(DropsWhatItIsTold(0.5, dropout), x).meta["fxopt_trace"].mode_dependent


def test_tracer_constants_do_not_make_a_model_mode_dependent():
    class Constant(nn.Module):
        def forward(self, x):
            return x * torch.tensor([1.0, 2.0, 3.0, 4.0])

    assert not trace(Constant(), torch.randn(3, 4)).meta["fxopt_trace"].mode_dependent


def test_ordered_dict_output_stays_an_ordered_dict():
    import collections

    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return collections.OrderedDict(out=self.lin(x), aux=x)

    out = trace(Returns(), torch.randn(3, 4))(torch.randn(3, 4))
    assert type(out) is collections.OrderedDict and list(out) == ["out", "aux"]


def test_buffer_updated_in_place_is_in_the_graph_and_tracing_leaves_it_alone():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2

    model = Counts()
    gm = trace(model, torch.randn(2))
    assert model.calls.item() == 0  # not run eagerly while tracing (twice: train and eval)
    gm(torch.randn(2))
    assert model.calls.item() == 1  # the graph updates the user's own buffer object


def test_buffer_assigned_in_forward_is_a_trace_error():
    class Reassigns(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls = self.calls + 1
            return x

    with pytest.raises(TraceError, match="assigns a new tensor to buffer 'calls'"):
        trace(Reassigns(), torch.randn(2))


def test_model_that_fails_on_its_inputs_is_an_input_error_with_the_source_line():
    class Projects(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    with pytest.raises(InputError) as info:
        trace(Projects(), torch.randn(2, 5))
    assert "does not run on these example inputs" in str(info.value)
    assert info.value.where.startswith("node lin (call_module lin) at ")
    assert "return self.lin(x).relu()" in info.value.where


def test_left_out_optional_arguments_take_their_defaults():
    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask=None):
            y = self.lin(x)
            return y if mask is None else y * mask

    x = torch.randn(2, 4)
    gm = trace(Optional(), x)
    assert "mul" not in gm.code
    torch.testing.assert_close(gm(x), gm.lin(x))
    gm = trace(Optional(), (x, torch.ones(2, 4)))
    assert "mul" in gm.code


USER_MODEL = """\
import torch
from torch import nn


class Gate(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x  # GATE LINE


class Wraps(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return self.gate(x) * 2  # WRAPS LINE


class RootFails(nn.Module):
    def forward(self, x):
        if x.mean() > 0:  # ROOT LINE
            return x * 2
        return x


class Projects(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()  # SHAPE LINE
"""


def test_a_users_code_under_a_folder_named_fxopt_is_still_the_users(tmp_path):
    """fxopt tells its own frames by where its packages really are, not by a folder's name: a
    user's project (or a clone of fxopt, whose tests are user code) may sit under .../fxopt/."""
    import importlib.util

    from fxopt import models_zoo
    from fxopt import passes
    import torchvision

    import fxopt
    from fxopt.capture.trace_checks import is_user_file
    from fxopt.measure.advice import user_source_line

    path = tmp_path / "fxopt" / "project" / "user_model.py"
    path.parent.mkdir(parents=True)
    path.write_text(USER_MODEL)
    line = {tag: n for n, text in enumerate(USER_MODEL.splitlines(), 1)
            for tag in ("GATE", "WRAPS", "ROOT", "SHAPE") if f"# {tag} LINE" in text}
    spec = importlib.util.spec_from_file_location("user_model_in_a_folder_named_fxopt", path)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)

    # the zoo's forwards are model code, named like the user's; fxopt's machinery is not
    assert is_user_file(str(path)) and is_user_file(torchvision.__file__)
    assert is_user_file(models_zoo.__file__)
    own = [m.__file__ for m in (fxopt, passes, torch)] + [trace.__code__.co_filename]
    assert not any(is_user_file(file) for file in own)

    with pytest.raises(TraceError) as info:  # the root's forward fails: user_frame
        trace(user.RootFails(), torch.randn(2, 4))
    assert f"<root> at {path}:{line['ROOT']} in forward: if x.mean() > 0:" in info.value.where

    gm = trace(user.Wraps(), torch.randn(2, 4))  # a submodule's forward fails: user_frame
    (leaf,) = gm.meta["fxopt_trace"].leaves
    assert f"({path}:{line['GATE']} in forward: return x if x.sum() > 0 else -x" in leaf.reason
    mul = next(n for n in gm.graph.nodes if n.op == "call_function")  # advice.user_source_line
    assert user_source_line(mul) == "return self.gate(x) * 2  # WRAPS LINE"

    with pytest.raises(InputError) as info:  # shapes fail: node_source
        trace(user.Projects(), torch.randn(2, 5))
    assert info.value.where == (f'node lin (call_module lin) at File "{path}", line '
                                f"{line['SHAPE']}, in forward: return self.lin(x).relu()  "
                                "# SHAPE LINE")


class ReadsItsTensors(nn.Module):
    """Reads Parameters and buffers as attributes in forward, one Parameter at two paths."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied: fx names it by its first path
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.inner = nn.Module()
        self.inner.register_buffer("shift", torch.ones(4))

    def forward(self, x):
        y = F.linear(x, self.b.weight, self.b.bias) * self.scale
        return y + self.inner.shift + self.a.weight.sum()


def test_tensor_reads_are_the_get_attr_nodes_fx_makes_and_name_the_users_line():
    """fxopt's tracer finds a read tensor by identity in an index instead of fx's walk of every
    module per read: the same get_attr nodes (a tied Parameter by its first path) as torch.fx's
    own tracer; each node's stack trace keeps the user's frame, as fx's does."""
    model = ReadsItsTensors()
    x = torch.randn(2, 4)
    gm = trace(model, x)

    class FxTracer(torch.fx.Tracer):
        proxy_buffer_attributes = True

    reference = torch.fx.Tracer.trace(FxTracer(), model)
    targets = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert targets == [n.target for n in reference.nodes if n.op == "get_attr"]
    assert targets == ["a.weight", "b.bias", "scale", "inner.shift"]  # one node per tensor
    torch.testing.assert_close(gm(x), model(x))
    mul = next(n for n in gm.graph.nodes if n.target is operator.mul)
    assert mul.stack_trace.endswith("y = F.linear(x, self.b.weight, self.b.bias) * self.scale")
    assert __file__ in mul.stack_trace and "site-packages" not in mul.stack_trace
