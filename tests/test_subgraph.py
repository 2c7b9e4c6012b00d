"""fxopt.rewrite.subgraph: a run of nodes' inputs and outputs, and the body cut out of it."""

import pytest
import torch
from torch import fx, nn

from fxopt.rewrite.subgraph import extract_subgraph, region_io


class Branchy(nn.Module):
    """A run (``conv`` .. ``add``) that reads the input, an earlier value and a parameter, and
    whose values are read after it twice (``add``) and once (``relu``)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.scale = nn.Parameter(torch.rand(1, 4, 1, 1) + 0.5)

    def forward(self, x):
        s = self.stem(x)
        h = self.conv(s)
        h = self.bn(h)
        r = torch.relu(h)
        a = r * self.scale + s
        b = a + x.mean()
        return b, r.sum(), a


@pytest.fixture
def traced():
    torch.manual_seed(0)
    gm = fx.symbolic_trace(Branchy())
    nodes = {n.name: n for n in gm.graph.nodes}
    run = [nodes[n] for n in ("conv", "bn", "relu", "scale", "mul", "add")]
    return gm, nodes, run


def _values(gm: fx.GraphModule, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every node's value in one run of ``gm`` (by node name)."""
    values: dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            values[n.name] = super().run_node(n)
            return values[n.name]

    Recorder(gm).run(x)
    return values


def test_region_io_inputs_in_first_use_order_and_outputs_read_outside(traced):
    gm, nodes, run = traced
    inputs, outputs = region_io(run)
    # ``stem`` is read first (by conv) and again by ``add``; the parameter is a get_attr: copied
    # into the body, not an input; ``x`` is not read inside the run at all
    assert inputs == [nodes["stem"]]
    # ``relu`` is read by ``sum`` outside, ``add`` by ``add_1`` and the output; ``mul`` only inside
    assert outputs == [nodes["relu"], nodes["add"]]


def test_region_io_of_a_run_reading_several_outside_values():
    graph = fx.Graph()
    x, y, z = (graph.placeholder(n) for n in "xyz")
    a = graph.call_function(torch.mul, (y, x))
    b = graph.call_function(torch.add, (a, z))
    c = graph.call_function(torch.sub, (b, y))
    graph.output((c, a))
    inputs, outputs = region_io([a, b])
    assert inputs == [y, x, z]      # first use, each once
    assert outputs == [a, b]        # a: by the output; b: by c
    assert region_io([a, b, c]) == ([y, x, z], [a, c])


def test_extracted_body_computes_the_same_values(traced):
    gm, nodes, run = traced
    code_before, nodes_before = gm.code, list(gm.graph.nodes)
    body = extract_subgraph(gm, run, class_name="Piece")
    assert type(body).__name__ == "Piece"
    assert gm.code == code_before and list(gm.graph.nodes) == nodes_before  # gm is not edited
    assert all(n.graph is gm.graph for n in run)
    placeholders = [n.name for n in body.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["stem"]
    assert [n.target for n in body.graph.nodes if n.op == "get_attr"] == ["scale"]

    gm.eval()  # BatchNorm from its running statistics: the same in both runs
    x = torch.randn(2, 3, 5, 5)
    values = _values(gm, x)
    got = body(values["stem"])
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got[0], values["relu"], rtol=0, atol=0)
    torch.testing.assert_close(got[1], values["add"], rtol=0, atol=0)


def test_body_shares_the_module_tree_and_gradients_reach_it(traced):
    gm, nodes, run = traced
    body = extract_subgraph(gm, run)
    assert body.get_submodule("conv") is gm.conv and body.get_submodule("bn") is gm.bn
    assert body.get_parameter("scale") is gm.scale
    stem_out = torch.randn(2, 4, 5, 5, requires_grad=True)
    relu, add = body(stem_out)
    (relu.sum() + add.sum()).backward()
    assert gm.conv.weight.grad is not None and gm.scale.grad is not None
    assert stem_out.grad is not None
    # training-mode BatchNorm in the body updates gm's own statistics
    assert int(gm.bn.num_batches_tracked) == 1


def test_single_output_is_returned_bare_and_meta_travels():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    nodes = list(gm.graph.nodes)
    nodes[0].meta["marker"] = "input meta"
    first, act = nodes[1], nodes[2]
    body = extract_subgraph(gm, [first, act])
    (placeholder,) = [n for n in body.graph.nodes if n.op == "placeholder"]
    assert placeholder.meta["marker"] == "input meta"
    x = torch.randn(5, 3)
    out = body(x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, torch.tanh(gm.get_submodule("0")(x)), rtol=0, atol=0)
