"""Checkpoint planning: which contiguous regions to recompute in backward, and how.

Decision only: ``plan_checkpoints(problem, budget)`` returns a ``CheckpointPlan``; the checkpoint
pass applies it. The problem is abstract -- nodes in forward order with their cost, the graph
values autograd saves for each, value sizes -- so the solver is testable on hand-made graphs.

Model. The forward is cut into *atoms* (a heavy op -- convolution, matmul -- and the cheap ops
after it). A plan is a path of arcs over atom boundaries; each arc is a run of atoms that is
either run normally, or recomputed in backward *fully* (only the region's inputs are kept) or
*selectively* (inputs plus the outputs of its heavy ops are kept; only cheap, memory-bound ops --
BatchNorm, activations, adds, dropout by RNG replay -- are recomputed). Memory is the size of the
*union* of kept values (a value saved by a normal node and also read by a later region counts
once), and it is checked where the peak really is: at the end of forward (everything kept), and
in backward as it reaches each node, when the values kept *before* it are still alive, later
ones already freed, the gradients of every parameter after it allocated, the gradients of the
activations in flight there (a value's gradient lives in backward over the same stretch of nodes
as the value does in forward: from its last reader back to its producer), and -- for a region --
its own saved tensors rebuilt.
Extra time is the summed forward cost of the recomputed ops.

Algorithm. Dynamic programming over atom boundaries (the Chen/Rotor family), with memory as a
discretised resource: ``best[state][m]`` is the least recompute time that reaches a boundary
having kept ``m`` bytes. The union is exact for values whose readers lie within a few atoms of
their producer (the DP state remembers which of those *pending* values are already kept);
long-lived values (DenseNet features, U-Net skips) are counted as kept from the moment they are
produced, which can only overestimate memory. The pass then checks every plan against a
fake-tensor run of the rewritten graph and tightens the budget if the model was optimistic.

Not handled: regions that are not contiguous in the current schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

FULL, SELECTIVE, NORMAL = "full", "selective", "normal"
REGION_OVERHEAD_SECONDS = 2e-5  # a checkpoint call's own cost; discourages needless tiny regions
_SHORT_LIVED_ATOMS = 4
_MAX_TRACKED_PENDING = 6


@dataclass(frozen=True)
class NodeInfo:
    """One forward node as the solver sees it."""

    name: str
    seconds: float                       # estimated forward time
    saved: frozenset[str] = frozenset()  # graph values autograd keeps for this node's backward
    internal_bytes: int = 0              # saved bytes that are no graph value (BN stats, masks)
    reads: frozenset[str] = frozenset()  # graph values this node reads
    heavy: bool = False                  # conv/matmul: kept by selective recompute
    recomputable: bool = True            # False for nodes that must never run twice
    mutates: str | None = None           # value this node overwrites in place, if any
    block: str | None = None             # the repeated block it runs in ("model.layers.3")
    grad_bytes: int = 0                  # parameter gradients this node's backward allocates
    grad_live_bytes: int = 0             # activation gradients alive while its backward runs


@dataclass
class CheckpointProblem:
    nodes: list[NodeInfo]
    value_bytes: dict[str, int]  # computed values only; params and graph inputs cost nothing here

    def kept_without_checkpointing(self) -> int:
        return modelled_bytes(self, CheckpointPlan())

    def backward_floor(self) -> list[int]:
        """backward_floor()[i]: bytes alive when backward reaches node i whatever the plan: the
        gradients of every parameter used at or after node i, and the activation gradients in
        flight there."""
        total, out = 0, [0] * (len(self.nodes) + 1)
        for i in range(len(self.nodes) - 1, -1, -1):
            total += self.nodes[i].grad_bytes
            out[i] = total + self.nodes[i].grad_live_bytes
        return out


@dataclass(frozen=True)
class Region:
    start: int  # index of the first node in problem.nodes
    stop: int   # one past the last
    mode: str
    extra_seconds: float
    recompute_bytes: int   # rebuilt in backward while the region is recomputed
    freed_bytes: int = 0   # kept bytes the region saves: what its nodes would keep run normally,
    #                        minus the inputs (and, if selective, heavy outputs) it keeps instead


@dataclass
class CheckpointPlan:
    regions: list[Region] = field(default_factory=list)
    kept_bytes: int = 0        # modelled peak of kept activations (see modelled_bytes)
    extra_seconds: float = 0.0
    solve_seconds: float = 0.0

    @property
    def empty(self) -> bool:
        return not self.regions


def atom_starts(problem: CheckpointProblem) -> list[int]:
    """Node indices where atoms begin: at node 0, at every heavy node, and at the first node of
    every repeated block. Without the last, a region could only start at a heavy node: a
    transformer layer opens with a norm before its first matmul, so every cut would keep both
    the residual stream and its normed copy, where a cut at the layer's start keeps one."""
    nodes = problem.nodes
    return [0] + [i for i, n in enumerate(nodes) if i and (
        n.heavy or (n.block is not None and n.block != nodes[i - 1].block))]


def block_plan(problem: CheckpointProblem) -> CheckpointPlan | None:
    """One full region per repeated block, what Hugging Face's ``gradient_checkpointing_enable``
    and torchtitan's full activation checkpointing do; None when the graph has no such blocks or
    none can be a region. A candidate the search weighs against the solver's own plans: the
    solver's model counts a region's whole recompute working set at once, which ranks one region
    per layer below two half-layer regions that keep twice the boundary values."""
    spans: list[tuple[int, int]] = []
    for i, node in enumerate(problem.nodes):
        if node.block is None:
            continue
        if spans and problem.nodes[spans[-1][1] - 1].block == node.block and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    if spans:  # the first block takes in what precedes it (embeddings), as far as allowed
        lo = spans[0][0]
        while lo > 0 and _region_allowed(problem.nodes[lo - 1:spans[0][1]]):
            lo -= 1
        spans[0] = (lo, spans[0][1])
    regions = []
    for lo, hi in spans:
        if hi - lo < 2 or not _region_allowed(problem.nodes[lo:hi]):
            continue
        arc = _arc(problem, lo, hi, FULL)
        freed = kept_by(problem, _arc(problem, lo, hi, NORMAL)) - kept_by(problem, arc)
        if freed > 0:
            regions.append(Region(lo, hi, FULL, arc.seconds, arc.working, freed))
    if not regions:
        return None
    plan = CheckpointPlan(regions, extra_seconds=sum(r.extra_seconds for r in regions))
    plan.kept_bytes = modelled_bytes(problem, plan)
    return plan


@dataclass(frozen=True)
class _Arc:
    lo: int  # node index range [lo, hi)
    hi: int
    mode: str
    seconds: float
    working: int           # bytes rebuilt while this region is recomputed
    keeps: frozenset[str]  # values this arc keeps alive for backward
    internal: int          # internal saved bytes kept (normal arcs)


def _arc(problem: CheckpointProblem, lo: int, hi: int, mode: str) -> _Arc:
    nodes = problem.nodes[lo:hi]
    inside = {n.name for n in nodes}
    if mode == NORMAL:
        keeps = set().union(*(n.saved for n in nodes))
        internal = sum(n.internal_bytes for n in nodes)
        return _Arc(lo, hi, mode, 0.0, 0, frozenset(keeps & problem.value_bytes.keys()), internal)
    inputs = set().union(*(n.reads for n in nodes)) - inside
    heavy = {n.name for n in nodes if n.heavy} if mode == SELECTIVE else set()
    keeps = (inputs | heavy) & problem.value_bytes.keys()
    seconds = sum(n.seconds for n in nodes if n.name not in heavy) + REGION_OVERHEAD_SECONDS
    rebuilt = (set().union(*(n.saved for n in nodes)) & inside) - heavy
    working = sum(problem.value_bytes.get(v, 0) for v in rebuilt) + sum(
        n.internal_bytes for n in nodes)
    return _Arc(lo, hi, mode, seconds, working, frozenset(keeps), 0)


def kept_by(problem: CheckpointProblem, arc: _Arc) -> int:
    """Bytes ``arc`` keeps alive for backward (values and internal saved tensors)."""
    return sum(problem.value_bytes[v] for v in arc.keeps) + arc.internal


def _region_allowed(nodes: list[NodeInfo]) -> bool:
    names = {n.name for n in nodes}
    return all(n.recomputable and (n.mutates is None or n.mutates in names) for n in nodes)


def _selective_allowed(nodes: list[NodeInfo]) -> bool:
    """A selective region needs a heavy op to keep, and must not overwrite what it keeps:
    torch's selective checkpointing refuses a kept output that is later mutated in place."""
    heavy = {n.name for n in nodes if n.heavy}
    return bool(heavy) and not any(n.mutates in heavy for n in nodes)


def _arcs(problem: CheckpointProblem, starts: list[int], max_region_atoms: int,
          modes: tuple[str, ...]) -> list[list[_Arc]]:
    """Arcs leaving each boundary: one normal atom, and region runs of up to max atoms."""
    bounds = starts + [len(problem.nodes)]
    leaving: list[list[_Arc]] = [[] for _ in bounds]
    for a in range(len(starts)):
        leaving[a].append(_arc(problem, bounds[a], bounds[a + 1], NORMAL))
        for b in range(a + 1, min(a + max_region_atoms, len(starts)) + 1):
            nodes = problem.nodes[bounds[a]:bounds[b]]
            if not _region_allowed(nodes):
                break
            for mode in modes:
                if mode == SELECTIVE and not _selective_allowed(nodes):
                    continue
                leaving[a].append(_arc(problem, bounds[a], bounds[b], mode))
    return leaving


def _lifetimes(problem: CheckpointProblem, starts: list[int]) -> tuple[dict[str, int], dict[str, int]]:
    """value -> atom of its producer, value -> last atom that reads or saves it."""
    atom_of = np.searchsorted(np.array(starts), np.arange(len(problem.nodes)), side="right") - 1
    produced, last = {}, {}
    for i, node in enumerate(problem.nodes):
        if node.name in problem.value_bytes:
            produced[node.name] = int(atom_of[i])
        for v in node.reads | node.saved:
            last[v] = max(last.get(v, -1), int(atom_of[i]))
    return produced, last


def plan_checkpoints(problem: CheckpointProblem, budget: int, *, max_region_atoms: int = 16,
                     buckets: int = 2048, modes: tuple[str, ...] = (FULL, SELECTIVE)
                     ) -> CheckpointPlan | None:
    """The least-recompute plan whose modelled memory fits ``budget`` bytes; None if none does.

    Memory is discretised into ``buckets`` levels with round-to-nearest; a plan that the exact
    union count (``modelled_bytes``) finds over budget is re-solved with the excess removed.
    """
    started = time.perf_counter()
    target = budget
    for _attempt in range(4):
        plan = _solve(problem, target, max_region_atoms, buckets, modes)
        if plan is None or plan.kept_bytes <= budget:
            break
        target -= plan.kept_bytes - budget
    else:
        plan = None
    if plan is not None:
        plan.solve_seconds = time.perf_counter() - started
    return plan if plan is not None and plan.kept_bytes <= budget else None


def _solve(problem: CheckpointProblem, budget: int, max_region_atoms: int, buckets: int,
           modes: tuple[str, ...]) -> CheckpointPlan | None:
    started = time.perf_counter()
    if problem.kept_without_checkpointing() <= budget:
        return CheckpointPlan(kept_bytes=problem.kept_without_checkpointing())
    starts = atom_starts(problem)
    leaving = _arcs(problem, starts, max_region_atoms, modes)
    produced, last = _lifetimes(problem, starts)
    long_lived = {v for v in problem.value_bytes if v in produced
                  and last.get(v, produced[v]) - produced[v] > _SHORT_LIVED_ATOMS}
    unit = max(budget, 1) / buckets
    boundary_of = {pos: k for k, pos in enumerate(starts + [len(problem.nodes)])}

    def pending_at(k: int) -> frozenset[str]:
        live = [v for v, p in produced.items()
                if p < k <= last.get(v, -1) and v not in long_lived]
        live.sort(key=lambda v: -problem.value_bytes[v])
        return frozenset(live[:_MAX_TRACKED_PENDING])

    pending = [pending_at(k) for k in range(len(starts) + 1)]
    search = _Search(problem, pending, boundary_of, long_lived, unit, buckets)
    search.open(0, frozenset()).cost[0] = 0.0
    for k, arcs in enumerate(leaving[:-1]):
        for state, table in list(search.tables[k].items()):
            reachable = np.nonzero(np.isfinite(table.cost))[0]
            for arc in arcs if reachable.size else ():
                search.relax(arc, k, state, table, reachable)
    choice = None
    for state, table in search.tables[len(starts)].items():
        m = int(np.argmin(table.cost))
        if np.isfinite(table.cost[m]) and (choice is None or table.cost[m] < choice[0]):
            choice = (table.cost[m], state, m)
    if choice is None:
        return None
    regions = search.trace_back(len(starts), choice[1], choice[2])
    plan = CheckpointPlan(regions=regions, extra_seconds=sum(r.extra_seconds for r in regions),
                          solve_seconds=time.perf_counter() - started)
    plan.kept_bytes = modelled_bytes(problem, plan)
    return plan


@dataclass
class _Table:
    """Least cost per memory bucket at one (boundary, state), with back-pointers."""

    cost: np.ndarray
    from_bucket: np.ndarray
    from_arc: np.ndarray
    from_state: list


class _Search:
    def __init__(self, problem, pending, boundary_of, long_lived, unit, buckets):
        self.problem, self.pending, self.boundary_of = problem, pending, boundary_of
        self.long_lived, self.unit, self.buckets = long_lived, unit, buckets
        self.tables: list[dict[frozenset[str], _Table]] = [dict() for _ in pending]
        self.arcs: list[tuple[_Arc, int, frozenset[str]]] = []
        self.floor = problem.backward_floor()

    def open(self, k: int, state: frozenset[str]) -> _Table:
        if state not in self.tables[k]:
            n = self.buckets + 1
            self.tables[k][state] = _Table(np.full(n, np.inf), np.full(n, -1),
                                           np.full(n, -1), [None] * 1)
        return self.tables[k][state]

    def relax(self, arc: _Arc, k: int, state: frozenset[str], table: _Table,
              reachable: np.ndarray) -> None:
        """Extend every reachable memory level at (k, state) by ``arc``."""
        charge, need = self._charge(arc, state)
        step = int(round(charge / self.unit))
        src = reachable[reachable <= self.buckets - int(round(need / self.unit))]
        if src.size == 0:
            return
        k2 = self.boundary_of[arc.hi]
        target = self.open(k2, (state | arc.keeps) & self.pending[k2])
        new_cost = table.cost[src] + arc.seconds
        dst = src + step
        better = new_cost < target.cost[dst]
        if not better.any():
            return
        self.arcs.append((arc, k, state))
        target.cost[dst[better]] = new_cost[better]
        target.from_bucket[dst[better]] = src[better]
        target.from_arc[dst[better]] = len(self.arcs) - 1

    def _charge(self, arc: _Arc, state: frozenset[str]) -> tuple[int, int]:
        """(bytes this arc adds to what is kept, the most it needs on top of what was kept).

        In backward, when a node is reached the plan-independent floor (parameter gradients,
        activation gradients in flight) is alive too; a region also needs its rebuilt working set. Long-lived values are charged once, by the
        arc that produces them.
        """
        values = self.problem.value_bytes
        if arc.mode != NORMAL:
            charge = sum(values[v] for v in arc.keeps
                         if v not in state and v not in self.long_lived)
            charge += sum(values[n.name] for n in self.problem.nodes[arc.lo:arc.hi]
                          if n.name in self.long_lived)
            return charge, charge + arc.working + max(self.floor[arc.lo:arc.hi], default=0)
        seen, charge, need = set(state), 0, 0
        for i in range(arc.lo, arc.hi):
            node = self.problem.nodes[i]
            fresh = {v for v in node.saved if v in values and v not in seen
                     and v not in self.long_lived}
            if node.name in self.long_lived:
                fresh.add(node.name)
            seen |= fresh
            charge += sum(values[v] for v in fresh) + node.internal_bytes
            need = max(need, charge + self.floor[i])
        return charge, need

    def trace_back(self, k: int, state: frozenset[str], m: int) -> list[Region]:
        regions = []
        while k > 0 or m > 0:
            table = self.tables[k][state]
            arc_id = int(table.from_arc[m])
            if arc_id < 0:
                break
            arc, k, state = self.arcs[arc_id]
            m = int(table.from_bucket[m])
            if arc.mode != NORMAL:
                normal = _arc(self.problem, arc.lo, arc.hi, NORMAL)
                freed = kept_by(self.problem, normal) - kept_by(self.problem, arc)
                regions.append(Region(arc.lo, arc.hi, arc.mode, arc.seconds, arc.working, freed))
        return sorted(regions, key=lambda r: r.start)


def modelled_bytes(problem: CheckpointProblem, plan: CheckpointPlan) -> int:
    """Peak kept bytes of ``plan`` under the solver's model, with the union computed exactly.

    The maximum of: everything kept at the end of forward, and for each region the bytes kept by
    the nodes before it (and by itself) plus its recompute working set.
    """
    regions = {r.start: r for r in plan.regions}
    floor = problem.backward_floor()
    kept: set[str] = set()
    internal = 0
    peak = 0
    i = 0
    while i < len(problem.nodes):
        if i in regions:
            region = regions[i]
            arc = _arc(problem, region.start, region.stop, region.mode)
            kept |= arc.keeps
            now = sum(problem.value_bytes[v] for v in kept) + internal
            peak = max(peak, now + arc.working + max(floor[region.start:region.stop]))
            i = region.stop
        else:
            node = problem.nodes[i]
            kept |= node.saved & problem.value_bytes.keys()
            internal += node.internal_bytes
            now = sum(problem.value_bytes[v] for v in kept) + internal
            peak = max(peak, now + floor[i])
            i += 1
    return max(peak, sum(problem.value_bytes[v] for v in kept) + internal)
