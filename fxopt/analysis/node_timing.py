"""Per-node forward times measured once on the device: what recomputing a node really costs.

``forward_seconds(gm)`` runs ``gm``'s forward for real, ``runs`` times, on random inputs shaped
like the example inputs (the placeholders' ``meta["val"]``: floating inputs standard normal,
integer and bool inputs zero), in train mode under ``torch.no_grad``, timing every call node
(synchronising the graph's own device around it on CUDA), and keeps each node's fastest run.
Parameters, buffers (BatchNorm statistics), gradients, module flags and the RNG are restored
afterwards. The random inputs are made on the devices of the placeholders' values.

It returns ``{}`` when the graph cannot run that way -- a model on the meta device, a leaf whose
forward needs meaningful integer inputs -- and the caller falls back to the roofline estimate
(``fxopt.analysis.costmodel``).

Why measure: one FLOP rate and one bandwidth rank ops badly on a CPU, where a training-mode
BatchNorm reaches a fraction of the copy bandwidth and a convolution a fraction of the matmul
rate, so the planner paid for recomputation it thought cheap. Costs one or two forwards.

Not handled: ops whose time depends on input values (a sort, data-dependent leaves): the random
inputs stand in for real ones.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import fx

from fxopt.graph.fake_run import training_flags
from fxopt.core.graphs import placeholder_values
from fxopt.core.state import preserved_state
from fxopt.core.tensors import graph_device, random_like, tensors_in
from fxopt.core.torch_private import tree_map_only

_CALLS = ("call_function", "call_method", "call_module")


class _TimedInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, seconds: dict[fx.Node, float]):
        super().__init__(gm)
        self.seconds = seconds
        device = graph_device(gm)
        # the graph's own device: a bare synchronize() waits for the *current* device only, so
        # a graph on cuda:1 would be timed by its launches
        self.cuda = device if device.type == "cuda" else None

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in _CALLS:
            return super().run_node(n)
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        start = time.perf_counter()
        result = super().run_node(n)
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        elapsed = time.perf_counter() - start
        self.seconds[n] = min(self.seconds.get(n, elapsed), elapsed)
        return result


def forward_seconds(gm: fx.GraphModule, *, runs: int = 2) -> dict[fx.Node, float]:
    """call node -> seconds of its fastest forward run; ``{}`` if the graph cannot be run."""
    values = placeholder_values(gm)
    tensors = tensors_in(values)
    state = [*gm.parameters(), *gm.buffers()]
    if any(t.device.type == "meta" for t in [*state, *tensors]):
        return {}
    seconds: dict[fx.Node, float] = {}
    try:
        with preserved_state(gm), training_flags(gm, True), torch.no_grad():
            inputs = tree_map_only(torch.Tensor, random_like, values)
            for _ in range(runs):
                _TimedInterpreter(gm, seconds).run(*inputs)
    except Exception:  # noqa: BLE001 -- any failure means: no profile, use the roofline
        return {}
    return seconds
