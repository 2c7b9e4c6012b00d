"""torch.compile of an optimized module with checkpointed regions, full and selective.

regions.py used to pass the bound method ``self._contexts`` as ``checkpoint``'s ``context_fn``;
dynamo keeps only the underlying function of it, so compiling failed with
``CheckpointedRegion._contexts() missing 1 required positional argument: 'self'``.
"""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn

import fxopt
from helpers import assert_same_step as same_step
from helpers import step_record
from fxopt.core.state import preserved_state
from fxopt.core.torch_private import compile_backend
from fxopt.runtime.regions import CheckpointedRegion


def conv_bn_relu_dropout(width: int = 8) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1)]
    for _ in range(2):
        layers += [nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(0.2),
                   nn.Conv2d(width, width, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 4))


@pytest.fixture(scope="module")
def optimized():
    """Budget 0.65 of the activations at the peak, roofline costs: conv1..dropout recomputed
    fully, conv2..dropout selectively."""
    torch.manual_seed(0)
    model, x = conv_bn_relu_dropout(), torch.randn(2, 3, 16, 16)
    gm = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": 0.65, "profile": False})])
    regions = [v for _, v in sorted(vars(gm).items()) if isinstance(v, CheckpointedRegion)]
    assert [region.selective for region in regions] == [False, True]
    return model, gm, x


def train_step(module: nn.Module, call, x: torch.Tensor):
    return step_record(module, x, seed=5, call=call)


def assert_same_step(got, expected) -> None:
    same_step(got, expected, buffer_tolerance={"rtol": 1e-6, "atol": 1e-7})


def test_compiled_matches_eager_and_the_original(optimized):
    model, gm, x = optimized
    torch.compiler.reset()
    expected = train_step(model, model, x)
    eager = train_step(gm, gm, x)
    compiled = train_step(gm, torch.compile(gm, backend="aot_eager"), x)
    assert_same_step(eager, expected)
    assert_same_step(compiled, expected)
    # BatchNorm's running statistics were updated once, not again by recomputation
    counts = {name: int(value) for name, value in compiled[2].items()
              if name.endswith("num_batches_tracked")}
    before = {name: int(b) for name, b in gm.named_buffers() if name in counts}
    assert len(counts) == 2 and counts == {name: n + 1 for name, n in before.items()}


def test_compiled_backward_recomputes_what_the_plan_says(optimized):
    """The full region's convolution is recomputed in the compiled backward, the selective
    region's is saved (SAC keeps heavy ops), and the head's is never checkpointed."""
    _, gm, x = optimized
    backward_graphs = []

    def record(graph, example_inputs):
        backward_graphs.append(graph)
        return make_boxed_func(graph.forward)

    def backend(graph, example_inputs):
        return compile_backend("aot_eager")(graph, example_inputs, bw_compiler=record)

    torch.compiler.reset()
    with preserved_state(gm):
        gm.train()
        torch.compile(gm, backend=backend)(x).sum().backward()
    (graph,) = backward_graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.convolution.default) == 1
    assert targets.count(torch.ops.aten.convolution_backward.default) == 3
