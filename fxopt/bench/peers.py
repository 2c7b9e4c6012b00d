"""The tools fxopt's checkpointing is compared with, built the way their users would build them.

- ``checkpoint_sequential``: ``torch.utils.checkpoint.checkpoint_sequential`` with sqrt(n)
  segments, the textbook recipe (Chen et al. 2016). It needs a chain of single-tensor stages, so
  the model is traced and cut at every point where exactly one value is alive (between ResNet
  blocks, between DenseNet blocks and transitions); the stages, in order, are the nn.Sequential
  it is given. A model without such cut points (a U-Net's skips span the whole network) yields
  few stages and little saving: that is the recipe's limit, not this adapter's. Known flaw of
  the recipe, kept: recomputation updates BatchNorm running statistics a second time.
- ``torch_compile_min_cut``: ``torch.compile`` with the min-cut rematerialization partitioner and
  ``torch._functorch.config.activation_memory_budget`` set to the budget as a fraction of
  activation memory. Backend ``aot_eager_decomp_partition`` on CPU (Inductor's decompositions and
  partitioner, eager kernels), ``inductor`` on CUDA.

Every peer shares the user's Parameter objects (it is built on a structural copy) and never
modifies the user's model. ``build_peer`` returns ``(module, note)``; ``module`` is None when the
peer cannot handle this model, and ``note`` then says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint_sequential

from fxopt.capture.trace import trace
from fxopt.core.modules import structural_copy
from fxopt.core.tensors import module_device
from fxopt.core.torch_private import (
    compile_backend,
    min_cut_memory_budget,
    recompiles_unlimited,
)
from fxopt.rewrite.subgraph import extract_subgraph


@dataclass(frozen=True)
class Peer:
    name: str
    summary: str
    build: Callable[[nn.Module, tuple, float], tuple[nn.Module | None, str]]


def single_value_cuts(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes after which exactly one computed value is alive: that node's own tensor result."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_read = {n: max((order[u] for u in n.users), default=order[n]) for n in gm.graph.nodes}
    cuts, alive = [], set()
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        alive = {v for v in alive if last_read[v] > order[node]}
        if node.users:
            alive.add(node)
        if alive == {node} and node.users and isinstance(node.meta.get("val"), torch.Tensor):
            cuts.append(node)
    return cuts


class SequentialCheckpointed(nn.Module):
    """``checkpoint_sequential(stages, segments, x)`` in training, the plain chain otherwise."""

    def __init__(self, stages: nn.Sequential, segments: int):
        super().__init__()
        self.stages = stages
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.stages(x)
        return checkpoint_sequential(self.stages, self.segments, x, use_reentrant=False)


def build_checkpoint_sequential(model: nn.Module, inputs: tuple, fraction: float
                                ) -> tuple[nn.Module | None, str]:
    """The sqrt(n) recipe over the model's single-tensor stages (``fraction`` is not used)."""
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        return None, "needs a model taking one tensor"
    gm = trace(model, inputs)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(output, fx.Node) or not nodes:
        return None, "needs a model returning one tensor"
    bounds = [nodes.index(c) + 1 for c in single_value_cuts(gm) if c in nodes]
    bounds = sorted(set(b for b in bounds if b < len(nodes))) + [len(nodes)]
    stages, start = [], 0
    for stop in bounds:
        stages.append(extract_subgraph(gm, nodes[start:stop], class_name="Stage"))
        start = stop
    segments = max(1, round(math.sqrt(len(stages))))
    return (SequentialCheckpointed(nn.Sequential(*stages), segments),
            f"{len(stages)} stages, {segments} segments")


class CompiledWithBudget(nn.Module):
    """``torch.compile`` of a copy of the model, compiled (and recompiled) under ``budget``.

    Its first call must compile at least one graph: one that did not (dynamo fell back to eager)
    raises, so a benchmark never reports eager steps as the compiled peer's."""

    def __init__(self, model: nn.Module, budget: float, backend: str):
        super().__init__()
        self.model = model
        self.budget = budget
        self.graphs = 0
        object.__setattr__(self, "compiled",
                           torch.compile(model, backend=self._own_backend(backend)))

    def forward(self, *args: Any) -> Any:
        first = self.graphs == 0
        with min_cut_memory_budget(self.budget), recompiles_unlimited():
            out = self.compiled(*args)
        if first and self.graphs == 0:
            raise RuntimeError(f"torch.compile ran {type(self.model).__name__} eager: dynamo "
                               "compiled no graph on the first call")
        return out

    def _own_backend(self, name: str) -> Callable[..., Any]:
        """The backend ``name`` behind a callable of this peer's own, counting the graphs it
        compiles. Dynamo keeps compiled code per code object and checks which backend made it,
        so a second budget on the same model class compiles anew instead of reusing the first
        budget's graph -- without ``torch._dynamo.reset()``, which would also throw away every
        compiled cache of the user's process."""
        inner = compile_backend(name)

        def backend(gm: Any, example_inputs: Any) -> Any:
            self.graphs += 1
            return inner(gm, example_inputs)

        return backend


def build_torch_compile(model: nn.Module, inputs: tuple, fraction: float
                        ) -> tuple[nn.Module | None, str]:
    on_cuda = module_device(model, inputs).type == "cuda"
    backend = "inductor" if on_cuda else "aot_eager_decomp_partition"
    return (CompiledWithBudget(structural_copy(model), fraction, backend),
            f"backend {backend}, activation_memory_budget={fraction:.2f}")


PEERS: dict[str, Peer] = {
    "checkpoint_sequential": Peer(
        "checkpoint_sequential", "torch.utils.checkpoint.checkpoint_sequential, sqrt(n) segments",
        build_checkpoint_sequential),
    "torch_compile_min_cut": Peer(
        "torch_compile_min_cut", "torch.compile min-cut partitioner with activation_memory_budget",
        build_torch_compile),
}


def build_peer(name: str, model: nn.Module, inputs: tuple, fraction: float
               ) -> tuple[nn.Module | None, str]:
    """Build peer ``name`` for ``model``; ``fraction`` is the activation-memory budget in [0, 1]."""
    return PEERS[name].build(model, inputs, fraction)
