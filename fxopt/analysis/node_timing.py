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
rate, so the planner paid for recomputation it thought cheap. Costs one or two forwards (one
when the first takes ``ONE_RUN_SECONDS`` or more).

Not handled: ops whose time depends on input values (a sort, data-dependent leaves): the random
inputs stand in for real ones.

``region_overhead(device)`` measures, once per process, what a checkpointed region costs on the
device beyond the forward time of what it recomputes: a per-call part and a part per saved tensor
(the planner's per-region cost, ``fxopt.analysis.costmodel.region_costs``).
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import torch
from torch import fx

from fxopt.graph.fake_run import training_flags
from fxopt.core.graphs import placeholder_values
from fxopt.core.state import preserved_state
from fxopt.core.tensors import graph_device, random_like, tensors_in
from fxopt.core.torch_private import tree_map_only
from fxopt.runtime.regions import CheckpointedRegion

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


# A forward at least this long is timed once: what a second run would remove (lazy set-up,
# first-touch page faults, cuDNN's autotuning) is then a small part of every node's time.
ONE_RUN_SECONDS = 1.0


def forward_seconds(gm: fx.GraphModule, *, runs: int = 2) -> dict[fx.Node, float]:
    """call node -> seconds of its fastest forward run; ``{}`` if the graph cannot be run.
    Runs after the first only while the forwards so far took under ``ONE_RUN_SECONDS``."""
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
                start = time.perf_counter()
                _TimedInterpreter(gm, seconds).run(*inputs)
                if time.perf_counter() - start >= ONE_RUN_SECONDS:
                    break
    except Exception:  # noqa: BLE001 -- any failure means: no profile, use the roofline
        return {}
    return seconds


class _Chain(torch.nn.Module):
    """``length`` sines in a row: a region of cheap nodes that each save one tensor."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.length):
            x = torch.sin(x)
        return x


@functools.cache
def region_overhead(device: str = "cpu", rounds: int = 60) -> tuple[float, float]:
    """(seconds a checkpointed region costs per call, seconds per tensor its recomputed nodes
    save) beyond the forward time of the nodes it recomputes, measured on ``device``: what the
    planner adds to a region's recompute time (``CheckpointProblem.region_seconds`` and
    ``saved_seconds``).

    Training steps of a chain of 1 and of 9 sines on an 8-element tensor, run plainly and as a
    region (``fxopt.runtime.regions.CheckpointedRegion``), alternated, with the chain's no-grad
    forward: a region's extra time minus that forward, per call (the fixed part) and per node
    (each sine saves one tensor). Medians of ``rounds`` rounds; the device is synchronised around
    each step. Measured once per process and device."""
    dev = torch.device(device)
    x = torch.randn(8, device=dev, requires_grad=True)
    cuda = dev.type == "cuda"

    def timed(step: Any) -> float:
        if cuda:
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    extra = {}
    for length in (1, 9):
        body = fx.symbolic_trace(_Chain(length))
        region = CheckpointedRegion(body, selective=False, targets=(), recompute=body,
                                    random=False, shield=False)
        arms = {"plain": lambda: body(x).sum().backward(),
                "region": lambda: region(x).sum().backward()}
        samples: dict[str, list[float]] = {"plain": [], "region": [], "forward": []}
        for _ in range(rounds + 1):  # the first round warms up
            for name, step in arms.items():
                samples[name].append(timed(step))
            with torch.no_grad():
                samples["forward"].append(timed(lambda: body(x)))
        x.grad = None
        medians = {k: statistics.median(v[1:]) for k, v in samples.items()}
        extra[length] = max(0.0, medians["region"] - medians["plain"] - medians["forward"])
    per_saved = max(0.0, (extra[9] - extra[1]) / 8)
    return max(0.0, extra[1] - per_saved), per_saved
