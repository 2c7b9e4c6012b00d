"""fxopt.analysis.writes: which argument nodes a node overwrites in place."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.analysis.aliases import alias_classes
from fxopt.analysis.writes import overwritten_by_a_user, overwritten_inputs
from fxopt.capture.trace import trace


class Writers(nn.Module):
    """Every in-place form fx can trace, each next to its out-of-place twin."""

    def __init__(self):
        super().__init__()
        self.act_inplace = nn.ReLU(inplace=True)
        self.act = nn.ReLU()
        self.leaky_inplace = nn.LeakyReLU(0.1, inplace=True)
        self.drop = nn.Dropout(0.5)  # has an ``inplace`` attribute, False
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x, y):
        a = x * 2
        b = a.add_(y)                          # method, trailing underscore
        c = b.add(y)                           # method, out of place
        d = torch.relu_(c)                     # torch function, trailing underscore
        e = torch.relu(d)                      # out of place
        f = F.relu(e, inplace=True)            # inplace=True keyword
        g = F.relu(f)                          # inplace left at its default
        h = self.act_inplace(g)                # module with inplace=True
        i = self.act(h)                        # module with inplace=False
        j = self.leaky_inplace(i)
        k = self.drop(j)
        v = k.view(-1)                         # a view is no write ...
        w = v.mul_(3)                          # ... but a write through it names the view
        t = k.transpose(0, 1).contiguous()
        n = F.batch_norm(t, self.mean, self.var, training=True)
        return n, w


@pytest.fixture(scope="module")
def traced():
    gm = fx.symbolic_trace(Writers())
    return gm, {n.name: n for n in gm.graph.nodes}


@pytest.mark.parametrize("node, written", [
    ("add_", "mul"), ("relu_", "add"), ("relu_1", "relu"), ("act_inplace", "relu_2"),
    ("leaky_inplace", "act"), ("mul_", "view"),
])
def test_in_place_ops_and_modules_name_their_first_argument(traced, node, written):
    gm, nodes = traced
    assert overwritten_inputs(gm, nodes[node]) == [nodes[written]]


@pytest.mark.parametrize("node", [
    "x", "mul", "add", "relu", "relu_2", "act", "drop", "view", "transpose", "contiguous",
    "mean", "output"])
def test_out_of_place_ops_views_placeholders_and_attributes_write_nothing(traced, node):
    gm, nodes = traced
    assert overwritten_inputs(gm, nodes[node]) == []


def test_traced_names_are_the_ones_the_tests_mean(traced):
    gm, nodes = traced
    assert nodes["relu_"].target is torch.relu_ and nodes["relu"].target is torch.relu
    assert nodes["relu_1"].kwargs == {"inplace": True}
    assert nodes["relu_2"].kwargs.get("inplace", False) is False
    assert nodes["act_inplace"].op == nodes["act"].op == "call_module"


def test_functional_batch_norm_writes_its_running_statistics(traced):
    gm, nodes = traced
    # not its input: batch_norm allocates a fresh output
    assert overwritten_inputs(gm, nodes["batch_norm"]) == [nodes["mean"], nodes["var"]]


@pytest.mark.parametrize("norm", [F.batch_norm, F.instance_norm])
def test_functional_norms_given_statistics_by_keyword(norm):
    graph = fx.Graph()
    x, mean, var = graph.placeholder("x"), graph.get_attr("mean"), graph.get_attr("var")
    node = graph.call_function(norm, (x,), {"running_mean": mean, "running_var": var})
    graph.output(node)
    root = nn.Module()
    root.register_buffer("mean", torch.zeros(3))
    root.register_buffer("var", torch.ones(3))
    assert overwritten_inputs(fx.GraphModule(root, graph), node) == [mean, var]


def test_batch_norm_without_running_statistics_writes_nothing():
    gm = fx.symbolic_trace(lambda x: F.batch_norm(x, None, None, training=True))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert overwritten_inputs(gm, node) == []


def _graph_calling(target, *extra_args):
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    node = graph.call_function(target, (x, *extra_args, y) if extra_args else (x, y))
    graph.output(x)
    return fx.GraphModule(nn.Module(), graph), node, x


@pytest.mark.parametrize("target", [operator.iadd, operator.imul, operator.isub,
                                    operator.itruediv])
def test_augmented_assignment_writes_its_left_operand(target):
    # symbolic tracing records ``x += y`` as ``add`` (a Proxy has no __iadd__); make_fx and
    # hand-built graphs have the operator itself
    gm, node, x = _graph_calling(target)
    assert overwritten_inputs(gm, node) == [x]


def test_item_assignment_writes_the_indexed_tensor():
    gm, node, x = _graph_calling(operator.setitem, 0)  # x[0] = y
    assert overwritten_inputs(gm, node) == [x]


def test_constant_first_argument_and_private_names_are_not_writes():
    graph = fx.Graph()
    x = graph.placeholder("x")
    private = graph.call_method("_version_", (x,))  # leading underscore: not an in-place op
    constant = graph.call_function(torch.relu_, (torch.ones(1),))
    graph.output((private, constant))
    gm = fx.GraphModule(nn.Module(), graph)
    assert overwritten_inputs(gm, private) == []
    assert overwritten_inputs(gm, constant) == []


def test_a_write_through_a_view_reaches_the_base_with_alias_classes():
    """writes.py names the view it writes through; aliases.py ties it to the base, together
    they say the base changed (what reorder and checkpoint rely on)."""

    class ViewWrite(nn.Module):
        def forward(self, x):
            base = x * 2
            flat = base.view(-1)
            flat.add_(1)
            return base

    gm = trace(ViewWrite(), (torch.randn(2, 3),))
    nodes = {n.name: n for n in gm.graph.nodes}
    (written,) = overwritten_inputs(gm, nodes["add_"])
    assert written is nodes["view"]
    classes = alias_classes(gm)
    assert classes[written] == classes[nodes["mul"]] != classes[nodes["x"]]


@pytest.mark.parametrize("norm", [torch.batch_norm, torch.instance_norm])
def test_aten_style_norms_write_their_running_statistics(norm):
    class AtenNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(3))
            self.register_buffer("mean", torch.zeros(3))
            self.register_buffer("var", torch.ones(3))

        def forward(self, x):
            return norm(x, self.weight, self.bias, self.mean, self.var, True, 0.1, 1e-5, False)

    gm = fx.symbolic_trace(AtenNorm())
    nodes = {n.name: n for n in gm.graph.nodes}
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert overwritten_inputs(gm, call) == [nodes["mean"], nodes["var"]]


class AtenWriters(nn.Module):
    """What torch.export records for in-place activations and BatchNorm in training."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.LeakyReLU(0.1, inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def test_aten_operators_write_what_their_schema_marks_and_batch_norm_its_statistics():
    from fxopt.capture.export_frontend import capture_with_export

    gm = capture_with_export(AtenWriters(), (torch.randn(2, 3, 8, 8),))
    by_target = {}
    for node in gm.graph.nodes:
        by_target.setdefault(node.target, []).append(node)
    (leaky,) = by_target[torch.ops.aten.leaky_relu_.default]
    assert overwritten_inputs(gm, leaky) == [leaky.args[0]]
    (norm,) = by_target[torch.ops.aten.batch_norm.default]
    written = overwritten_inputs(gm, norm)
    assert [w.target for w in written] == ["bn.running_mean", "bn.running_var"]
    (conv,) = by_target[torch.ops.aten.conv2d.default]
    assert overwritten_inputs(gm, conv) == []
    # the one in-place detector pad_channels asks too (it had a name-suffix one of its own,
    # blind to ATen overloads: "leaky_relu_.default" does not end in "_")
    assert overwritten_by_a_user(gm, leaky.args[0]) and not overwritten_by_a_user(gm, leaky)
    assert overwritten_by_a_user(gm, norm.args[3]) and not overwritten_by_a_user(gm, conv)
