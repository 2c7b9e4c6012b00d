"""Memory-aware schedules: legal orders of a graph's nodes, and which one has the lowest peak.

FX's generated code already drops each value after its last use, so the only lever left without
recomputation is *when* each value is computed. ``choose_schedule(gm)`` builds several legal
orders -- the original, breadth-first, depth-first, and a greedy order that picks the ready node
with the smallest net allocation (bytes it allocates minus bytes it lets FX free; in train mode
values saved for backward never count as freed) -- screens them by liveness (``static_peak``),
scores the promising ones with ``estimate_peak`` (a fake-tensor run of the real forward and
backward) and returns the best. The original order always competes and wins ties.

Legal means: data dependencies, the relative order of every node with side effects (in-place
ops, RNG consumers such as dropout, opaque leaf modules, BatchNorm buffer updates) is kept, and a
node that mutates a value stays after every earlier reader of it.

Decision only: ``gm`` is never edited (``passes.reorder`` applies the order).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxopt.analysis import alias_classes, saved_for_backward
from fxopt.analysis.estimate import estimate_inference_peak, estimate_train_peak
from fxopt.core.training_setup import TrainingSetup
from fxopt.analysis.randomness import draws_random_numbers
from fxopt.analysis.writes import overwritten_inputs
from fxopt.core.graphs import placeholder_values
from fxopt.graph.graphs import graph_module_like
from fxopt.core.tensors import storage_bytes
from fxopt.core.torch_private import copy_codegen

MIN_PROMISED_SAVING = 0.01  # of the original order's screened forward peak

_PURE_MODULES = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Linear, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d, nn.Flatten, nn.Identity, nn.Upsample, nn.Softmax, nn.LogSoftmax,
    nn.GELU, nn.Sigmoid, nn.Tanh,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.ELU, nn.SELU, nn.CELU, nn.SiLU, nn.Hardswish,
    nn.Hardsigmoid, nn.Mish,
)


def has_side_effects(gm: fx.GraphModule, node: fx.Node) -> bool:
    """True when moving ``node`` relative to another such node could change results."""
    if node.op in ("placeholder", "output"):
        return True
    if overwritten_inputs(gm, node):
        return True
    if node.op == "call_module":
        return not isinstance(gm.get_submodule(node.target), _PURE_MODULES)
    return draws_random_numbers(gm, node)


def dependencies(gm: fx.GraphModule) -> dict[fx.Node, set[fx.Node]]:
    """node -> nodes that must run before it (data, side-effect order, readers before writers)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    aliases = alias_classes(gm, either_mode=True)
    deps: dict[fx.Node, set[fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
    previous_effect = None
    for node in nodes:
        if has_side_effects(gm, node):
            if previous_effect is not None:
                deps[node].add(previous_effect)
            previous_effect = node
        for mutated in overwritten_inputs(gm, node):
            group = {n for n, c in aliases.items() if c == aliases.get(mutated)} | {mutated}
            for member in group:
                deps[node].update(u for u in member.users if position[u] < position[node])
    for node in nodes:
        deps[node].discard(node)
    return deps


def _nbytes(node: fx.Node) -> int:
    """Bytes a tensor-valued node allocates (0 for tuples: their items are counted where they
    are taken apart, which is where FX frees them)."""
    val = node.meta.get("val")
    return storage_bytes(val) if isinstance(val, torch.Tensor) else 0


def _schedule(nodes: list[fx.Node], deps: dict[fx.Node, set[fx.Node]],
              priority: Callable[[fx.Node, set[fx.Node]], Any]) -> list[fx.Node]:
    """Kahn's algorithm; among ready nodes the smallest ``priority(node, scheduled)`` goes first."""
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    waiting = {n: len(deps[n]) for n in nodes}
    for node in nodes:
        for dep in deps[node]:
            users[dep].append(node)
    scheduled: set[fx.Node] = set()
    order: list[fx.Node] = []
    ready = [(priority(n, scheduled), i, n) for i, n in enumerate(nodes) if waiting[n] == 0]
    heapq.heapify(ready)
    index = {n: i for i, n in enumerate(nodes)}
    while ready:
        _, _, node = heapq.heappop(ready)
        scheduled.add(node)
        order.append(node)
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (priority(user, scheduled), index[user], user))
    # Priorities are computed when a node becomes ready; rescoring all ready nodes each step
    # would be more exact and O(n^2), which the scoring by estimate_peak below makes unnecessary.
    return order


def _saved_values(gm: fx.GraphModule, train: bool) -> set[fx.Node]:
    saved: set[fx.Node] = set()
    if train:
        for info in saved_for_backward(gm, placeholder_values(gm)).values():
            saved.update(info.values)
    return saved


def candidate_orders(gm: fx.GraphModule, saved: set[fx.Node]) -> dict[str, list[fx.Node]]:
    """Legal orders of ``gm``'s nodes by several strategies; ``saved`` values never free."""
    nodes = list(gm.graph.nodes)
    deps = dependencies(gm)
    index = {n: i for i, n in enumerate(nodes)}

    def net_bytes(node: fx.Node, scheduled: set[fx.Node]) -> tuple[int, int]:
        freed = sum(_nbytes(i) for i in node.all_input_nodes
                    if i not in saved and all(u in scheduled or u is node for u in i.users))
        return (_nbytes(node) - freed, index[node])

    counter = iter(range(10**9))
    return {
        "original": nodes,
        "bfs": _schedule(nodes, deps, lambda n, s: index[n]),
        "dfs": _schedule(nodes, deps, lambda n, s: -next(counter)),
        "least_net_alloc": _schedule(nodes, deps, net_bytes),
    }


def static_peak(order: list[fx.Node], aliases: dict[fx.Node, int], saved: set[fx.Node]) -> int:
    """Peak bytes of the forward run in ``order`` by liveness alone: a storage (alias class) is
    alive from its first member to the last reader of any member, for ever if it is saved for
    backward. A cheap screen; ``estimate_peak`` has the last word."""
    position = {n: i for i, n in enumerate(order)}
    size: dict[int, int] = {}
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for node in order:
        cls = aliases.get(node)
        if cls is None or node.op in ("placeholder", "get_attr"):
            continue
        size[cls] = max(size.get(cls, 0), _nbytes(node))
        start[cls] = min(start.get(cls, position[node]), position[node])
        last = max((position[u] for u in node.users), default=position[node])
        end[cls] = len(order) if node in saved else max(end.get(cls, 0), last)
    delta = [0] * (len(order) + 2)
    for cls, bytes_ in size.items():
        delta[start[cls]] += bytes_
        delta[end[cls] + 1] -= bytes_
    peak = live = 0
    for change in delta:
        live += change
        peak = max(peak, live)
    return peak


def graph_in_order(graph: fx.Graph, order: list[fx.Node]) -> fx.Graph:
    """A new graph with ``graph``'s nodes in ``order`` (``graph`` itself is not changed)."""
    new = fx.Graph()
    copy_codegen(graph, new)
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        env[node] = new.node_copy(node, lambda n: env[n])
    return new


@dataclass
class ScheduleDecision:
    """The order to run ``gm``'s nodes in, or None to keep the original; ``stats`` say why."""

    order: list[fx.Node] | None
    stats: dict[str, Any] = field(default_factory=dict)


def choose_schedule(gm: fx.GraphModule, *, train: bool = True,
                    training: TrainingSetup | None = None) -> ScheduleDecision:
    """The candidate order with the lowest predicted peak (train or inference) of the training
    ``training`` describes, or None.

    Candidate orders are screened by ``static_peak``; only when some candidate promises a peak
    at least ``MIN_PROMISED_SAVING`` lower than the original's are the original and the
    promising candidates scored by ``estimate_train_peak`` (a fake-tensor run of forward and
    backward each) or ``estimate_inference_peak``. A smaller promise is not worth those runs,
    and such a saving is given up (``tests/test_reorder.py`` has one of 0.1%): on a 4-layer
    Llama the screen promised 8,208 bytes of 356 MB; the two runs cost 0.8 s, more than half
    of its passes' time, and found the same peak.
    """
    saved = _saved_values(gm, train)
    aliases = alias_classes(gm, either_mode=True)
    orders = candidate_orders(gm, saved)
    screened = {name: static_peak(order, aliases, saved) for name, order in orders.items()}
    worth_scoring = screened["original"] * (1 - MIN_PROMISED_SAVING)
    promising = [name for name, order in orders.items() if name != "original"
                 and order != orders["original"] and screened[name] < worth_scoring]
    stats: dict[str, Any] = {"strategy": "original", "screened": screened}
    if not promising:
        stats["reason"] = ("no candidate order lowers the forward peak by "
                           f"{MIN_PROMISED_SAVING:.0%} or more (static screen)")
        return ScheduleDecision(None, stats)
    inputs = placeholder_values(gm)
    scores: dict[str, int] = {}
    for name in ["original", *promising]:
        graph = gm.graph if name == "original" else graph_in_order(gm.graph, orders[name])
        candidate = graph_module_like(gm, graph)
        scores[name] = (estimate_train_peak(candidate, inputs, training=training).bytes
                        if train else estimate_inference_peak(candidate, inputs,
                                                              training=training))
    best = min(scores, key=lambda k: (scores[k], k != "original"))
    stats.update({"strategy": best, "predicted_before": scores["original"],
                  "predicted_after": scores[best], "candidates": scores})
    return ScheduleDecision(None if best == "original" else orders[best], stats)
