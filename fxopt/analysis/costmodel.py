"""How long each forward node takes: measured once on the device, or a roofline estimate.

``node_costs(gm)`` takes each node's time from one real profile of the forward
(``fxopt.analysis.node_timing``) where the graph can run on random inputs; otherwise, and for FLOPs and
bytes always, from the roofline below.

The roofline counts each node's FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` during a
fake-tensor run (so no compute), and its memory traffic as the bytes of its tensor inputs and
output. Seconds = max(FLOPs / peak FLOP rate, bytes / memory bandwidth) (``roofline_seconds``).
With ``profile=False`` the rates are ``NOMINAL_RATES``, fixed per device type: no compute at all,
and the same costs in every process (so the same plan on every run and every DDP rank; measured
rates differ from one process to the next by 10-20% on a busy machine, enough to flip near-equal
plans). With ``profile=True`` the nodes the profile cannot time use rates measured once per
process and device by ``device_rates`` (a matmul and a large copy, a few tens of milliseconds).
It ranks a convolution against a BatchNorm the right way round but is far off on
a CPU for memory-bound ops (resnet50, 8x3x128x128, one thread: a training-mode BatchNorm 8x and
a max-pool 40x slower than the roofline says), hence the profile.

A node is *heavy* when one of ``fxopt.runtime.regions.HEAVY_ATEN_OPS`` runs inside it (seen by a
dispatch mode during the same fake run): exactly the ops whose outputs a selective region keeps
at run time, so what the planner assumes a selective region keeps is what it keeps.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from fxopt.analysis.node_timing import forward_seconds, region_overhead
from fxopt.graph.meta import propagate_meta
from fxopt.core.graphs import placeholder_values
from fxopt.core.tensors import graph_device, tensor_bytes
from fxopt.core.torch_private import TorchDispatchMode
from fxopt.runtime.regions import is_heavy, is_light


@dataclass(frozen=True)
class NodeCost:
    flops: int
    bytes: int
    seconds: float
    heavy: bool = False
    random: bool = False  # an op drawing from the RNG ran inside it (dropout, in training)
    light: bool = False   # every op that ran inside it is light (``fxopt.runtime.regions.is_light``)


class _HeavyOpSeen(TorchDispatchMode):
    """Records whether any op selective recomputation keeps ran while it was active, any op
    that draws random numbers (ATen's ``nondeterministic_seeded`` tag), and whether every op
    was light (what a light region recomputes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False
        self.random = False
        self.ops = 0
        self.light = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        self.seen = self.seen or is_heavy(func)
        self.random = self.random or torch.Tag.nondeterministic_seeded in func.tags
        self.ops += 1
        self.light = self.light and is_light(func)
        return func(*args, **(kwargs or {}))


# (FLOP/s, bytes/s) of the roofline when nothing is measured (``profile=False``).
NOMINAL_RATES = {"cpu": (1e11, 5e10), "cuda": (5e13, 3e12)}


def roofline_seconds(flops: int, nbytes: int, rates: tuple[float, float]) -> float:
    """A node's time by the roofline: bound by its FLOPs or by the bytes it moves."""
    return max(flops / rates[0], nbytes / rates[1])


@functools.cache
def device_rates(device: str = "cpu") -> tuple[float, float]:
    """(FLOP/s, bytes/s) measured on ``device`` with a matmul and a large copy."""
    dev = torch.device(device)
    a = torch.randn(512, 512, device=dev)
    big = torch.empty(8 * 1024 * 1024 // 4, device=dev)

    def timed(fn, reps: int) -> float:
        """The fastest of ``reps`` runs: what the device can do, least disturbed by other load
        (a mean would make plans depend on what else the machine was doing at that moment)."""
        fn()
        best = float("inf")
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - start)
        return best

    flops = 2 * 512**3 / timed(lambda: a @ a, 9)
    bandwidth = 2 * big.numel() * 4 / timed(lambda: big.clone(), 9)
    return flops, bandwidth


# (seconds per region call, seconds per tensor its recomputed nodes save) when nothing is measured
# (``profile=False``): what ``region_overhead`` measured on this project's CPU, and the same host
# bookkeeping plus kernel launches on a GPU.
NOMINAL_REGION_COSTS = {"cpu": (2.5e-5, 5e-6), "cuda": (5e-5, 5e-6)}


def region_costs(gm: fx.GraphModule, *, profile: bool = True) -> tuple[float, float]:
    """What a checkpointed region costs beyond recomputing its nodes, on ``gm``'s device:
    (seconds per call, seconds per tensor its recomputed nodes save). Measured there once per
    process (``fxopt.analysis.node_timing.region_overhead``); ``NOMINAL_REGION_COSTS`` with
    ``profile=False`` or where nothing can run (the meta device). The planner adds it to every
    region, so where a call costs more (a GPU at small sizes) it plans fewer, larger regions."""
    device = graph_device(gm)
    kind = "cuda" if device.type == "cuda" else "cpu"
    if not profile or device.type not in ("cpu", "cuda"):
        return NOMINAL_REGION_COSTS[kind]
    return region_overhead(str(device))


def node_costs(gm: fx.GraphModule, *, profile: bool = True) -> dict[fx.Node, NodeCost]:
    """Forward cost of every call node (placeholders, get_attr and output cost nothing).

    ``profile=False``: roofline seconds at ``NOMINAL_RATES`` only (no real compute at all, the
    same in every process).
    """
    flops: dict[fx.Node, int] = {}
    heavy: dict[fx.Node, bool] = {}
    random: dict[fx.Node, bool] = {}
    light: dict[fx.Node, bool] = {}

    @contextlib.contextmanager
    def count(node: fx.Node) -> Iterator[None]:
        counter, seen = FlopCounterMode(display=False), _HeavyOpSeen()
        with counter, seen:
            yield
        flops[node] = counter.get_total_flops()
        heavy[node] = seen.seen
        random[node] = seen.random
        light[node] = seen.light and seen.ops > 0

    propagate_meta(gm, placeholder_values(gm), around_node=count)
    device = "cuda" if graph_device(gm).type == "cuda" else "cpu"
    rates = device_rates(device) if profile else NOMINAL_RATES[device]
    measured = forward_seconds(gm) if profile else {}
    costs = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        moved = tensor_bytes([a.meta.get("val") for a in node.all_input_nodes]) + tensor_bytes(
            node.meta.get("val"))
        f = flops.get(node, 0)
        roofline = roofline_seconds(f, moved, rates)
        costs[node] = NodeCost(f, moved, measured.get(node, roofline), heavy.get(node, False),
                               random.get(node, False), light.get(node, False))
    return costs
