"""Checkpoint planning: which contiguous regions to recompute in backward, and how.

Decision only: ``plan_checkpoints(problem, budget)`` returns a ``CheckpointPlan``; the checkpoint
pass applies it. The problem is abstract -- nodes in forward order with their cost, the graph
values autograd saves for each, value sizes -- so the solver is testable on hand-made graphs.

Model. The forward is cut into *atoms* (a heavy op -- convolution, matmul -- and the cheap ops
after it). A plan is a path of arcs over atom boundaries; each arc is a run of atoms that is
either run normally, or recomputed in backward *fully* (only the region's inputs are kept) or
*selectively* (inputs plus the outputs of its heavy ops are kept; only cheap, memory-bound ops --
BatchNorm, activations, adds, dropout by RNG replay -- are recomputed), or *lightly* (only its
light ops -- concatenations, pointwise arithmetic without state or random numbers, views, casts --
are recomputed; every other node's output that they read is kept: DenseNet's concatenation
before each BatchNorm, recomputed at a fraction of a BatchNorm's cost, which Pleiss et al.'s
memory-efficient DenseNet does by hand). Memory is the size of the
*union* of kept values (a value saved by a normal node and also read by a later region counts
once), and it is checked where the peak really is: at the end of forward (everything kept), and
in backward as it reaches each node, when the values kept *before* it are still alive, later
ones already freed, the gradients of every parameter after it allocated, the gradients of the
activations in flight there (a value's gradient lives in backward over the same stretch of nodes
as the value does in forward: from its last reader back to its producer), and -- for a region --
its own saved tensors rebuilt.
Extra time is the summed forward cost of the recomputed ops plus what a region costs as such on
the device (``CheckpointProblem.region_seconds`` per region and ``saved_seconds`` per tensor its
recomputed ops save, measured where the planner runs): where a region call is dear relative to
the ops (a GPU, tiny inputs) the cheapest plan has fewer, larger regions, and a selective region
(which recomputes BatchNorm, activations and adds but keeps convolutions and matmuls) beats a full
one wherever the memory allows.

Algorithm. Dynamic programming over atom boundaries (the Chen/Rotor family), with memory as a
discretised resource: ``best[state][m]`` is the least recompute time that reaches a boundary
having kept ``m`` bytes. The union is exact for values whose readers lie within a few atoms of
their producer (the DP state remembers which of those *pending* values are already kept);
long-lived values (DenseNet features, U-Net skips) are counted as kept from the moment they are
produced, which can only overestimate memory. Levels are only a key: each cell also holds the
exact bytes its path keeps, which decide whether an arc fits, and they span what can be kept,
not the budget (most of which can be parameter gradients), so rounding neither refuses a plan
that fits nor accepts one that does not. The pass then checks every plan against a fake-tensor
run of the rewritten graph and tightens the budget if the model was optimistic.

Not handled: regions that are not contiguous in the current schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

FULL, SELECTIVE, LIGHT, NORMAL = "full", "selective", "light", "normal"
MODES = (FULL, SELECTIVE, LIGHT)  # the region modes a plan may use
REGION_OVERHEAD_SECONDS = 2e-5  # a region call's own cost in hand-made problems (measured otherwise)
_SHORT_LIVED_ATOMS = 4
_MAX_TRACKED_PENDING = 6
_CHECKED_ENDS = 16  # DP end cells traced back and counted exactly, cheapest first


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
    random: bool = False                 # draws random numbers (dropout): a region holding it
    #                                      replays the RNG, and a selective one recomputes it
    light: bool = False                  # only pointwise, copying and view ops run in it, with
    #                                      no random numbers and no in-place write: what a light
    #                                      region recomputes (fxopt.runtime.regions.is_light)

    @property
    def keepable(self) -> bool:
        """Whether a selective region keeps this node's output instead of recomputing it: a
        heavy node that draws no random numbers (skipping it in the recomputation would shift
        the random numbers of the nodes after it) and writes nothing in place (its writes would
        not happen again)."""
        return self.heavy and not self.random and self.mutates is None


@dataclass
class CheckpointProblem:
    nodes: list[NodeInfo]
    value_bytes: dict[str, int]  # computed values only; params and graph inputs cost nothing here
    # True lets a region span repeated blocks: a flat module (blocks not kept as calls), for
    # measuring what keeping them costs (benchmarks/block_structure.py)
    regions_across_blocks: bool = False
    # what a region costs beyond recomputing its nodes, on the device that runs it: the region
    # call's own bookkeeping in forward and backward (``region_seconds``), and a little per tensor
    # its nodes save (``saved_seconds``: each goes through a Python hook twice). Measured by
    # ``fxopt.analysis.node_timing.region_overhead``; these defaults are for hand-made problems.
    region_seconds: float = REGION_OVERHEAD_SECONDS
    saved_seconds: float = 0.0
    # what every solve of this problem starts from, whatever its budget (``_prepared``)
    _prepared: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
    kept: tuple[int, ...] = ()  # nodes (indices in problem.nodes) whose outputs it keeps
    random: bool = True    # whether a node of it draws random numbers (its RNG state is replayed)


def make_region(problem: CheckpointProblem, lo: int, hi: int, mode: str, seconds: float,
                working: int, freed: int) -> Region:
    """The region over nodes [lo, hi) in ``mode``, with what it keeps and whether it draws
    random numbers."""
    nodes = problem.nodes[lo:hi]
    names = kept_names(nodes, mode)
    kept = tuple(i for i, n in enumerate(nodes, start=lo) if n.name in names)
    # only what the recomputation runs again replays the RNG: a light region keeps dropout
    return Region(lo, hi, mode, seconds, working, freed, kept,
                  any(n.random for n in nodes if n.name not in names))


def kept_names(nodes: list[NodeInfo], mode: str) -> set[str]:
    """The nodes of a region in ``mode`` whose outputs it keeps instead of recomputing them:
    none when full, the heavy ones when selective (``NodeInfo.keepable``), all but the light ones
    when light."""
    if mode == SELECTIVE:
        return {n.name for n in nodes if n.keepable}
    if mode == LIGHT:
        return {n.name for n in nodes if not n.light}
    return set()


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
    """Node indices where atoms begin: at node 0, at every heavy node, where a repeated block
    begins or ends (a region lies in one block), and around every node that must not be
    recomputed (an atom holding one could never be in a region: padded BatchNorm writes its
    statistics back after every layer). Without the block starts, a region could only start at
    a heavy node: a transformer layer opens with a norm before its first matmul, so every cut
    would keep both the residual stream and its normed copy, where a cut at the layer's start
    keeps one."""
    nodes = problem.nodes
    return [0] + [i for i, n in enumerate(nodes) if i and (
        n.heavy or n.block != nodes[i - 1].block
        or not n.recomputable or not nodes[i - 1].recomputable)]


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
    regions, floor = [], problem.backward_floor()
    for lo, hi in spans:
        if hi - lo < 2 or not _region_allowed(problem.nodes[lo:hi],
                                              problem.regions_across_blocks):
            continue
        arc = _arc(problem, lo, hi, FULL, floor)
        freed = kept_by(problem, _arc(problem, lo, hi, NORMAL)) - kept_by(problem, arc)
        if freed > 0:
            regions.append(make_region(problem, lo, hi, FULL, arc.seconds, arc.working, freed))
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
    backward: int = 0      # regions: the most bytes alive on top of what is kept while backward
    #                        runs through the region (its rebuilt tensors, the floor)


def _arc(problem: CheckpointProblem, lo: int, hi: int, mode: str,
         floor: list[int] | None = None) -> _Arc:
    """The arc over nodes [lo, hi) in ``mode``; ``floor``: ``problem.backward_floor()``, given
    by callers that build many arcs (computed here otherwise).

    A region's backward: its nodes are recomputed at once when backward reaches it, and each
    rebuilt tensor is freed once backward has passed the first node that saved it, while the
    floor (parameter gradients, activation gradients in flight) grows towards the region's
    start. So the most it needs is the largest, over its nodes i, of the rebuilt tensors still
    alive at i's backward plus ``floor[i]``, not the whole working set at the largest floor.
    """
    nodes = problem.nodes[lo:hi]
    inside = {n.name for n in nodes}
    if mode == NORMAL:
        keeps = set().union(*(n.saved for n in nodes))
        internal = sum(n.internal_bytes for n in nodes)
        return _Arc(lo, hi, mode, 0.0, 0, frozenset(keeps & problem.value_bytes.keys()), internal)
    inputs = set().union(*(n.reads for n in nodes)) - inside
    heavy = kept_names(nodes, mode)
    recomputed = [n for n in nodes if n.name not in heavy]
    if mode == LIGHT:
        # the kept outputs the recomputation reads, and what kept nodes save that it does not
        # rebuild (kept as forward saved it); the rest of what kept nodes make is freed as usual
        again = inside - heavy
        read = set().union(*(n.reads for n in recomputed)) & inside
        keeps = (inputs | (read - again)
                 | (set().union(*(n.saved for n in nodes if n.name in heavy)) - again))
    else:
        keeps = inputs | heavy
    keeps &= problem.value_bytes.keys()
    seconds = (sum(n.seconds for n in recomputed) + problem.region_seconds
               + problem.saved_seconds * sum(len(n.saved) + bool(n.internal_bytes)
                                             for n in recomputed))
    # a kept node's own saved results (attention's log-sum-exp) stay with its output
    internal = sum(n.internal_bytes for n in nodes if n.name in heavy)
    rebuilt = (set().union(*(n.saved for n in nodes)) & inside) - heavy
    working = sum(problem.value_bytes.get(v, 0) for v in rebuilt) + sum(
        n.internal_bytes for n in recomputed)
    if floor is None:
        floor = problem.backward_floor()
    alive, backward, pending = 0, 0, set(rebuilt)
    for i, node in enumerate(nodes, start=lo):
        first_saved = pending & node.saved
        pending -= first_saved
        alive += sum(problem.value_bytes.get(v, 0) for v in first_saved)
        alive += node.internal_bytes if node.name not in heavy else 0
        backward = max(backward, alive + floor[i])
    return _Arc(lo, hi, mode, seconds, working, frozenset(keeps), internal, backward)


def kept_by(problem: CheckpointProblem, arc: _Arc) -> int:
    """Bytes ``arc`` keeps alive for backward (values and internal saved tensors)."""
    return sum(problem.value_bytes[v] for v in arc.keeps) + arc.internal


def _region_allowed(nodes: list[NodeInfo], across_blocks: bool = False) -> bool:
    """A region recomputes what it may, writes only what it makes, and lies in one repeated
    block or outside all of them: blocks stay calls of their own (``fxopt.rewrite.blocks``),
    the unit FSDP2 gathers and torch.compile compiles."""
    names = {n.name for n in nodes}
    return ((across_blocks or len({n.block for n in nodes}) <= 1)
            and all(n.recomputable and (n.mutates is None or n.mutates in names) for n in nodes))


def _selective_allowed(nodes: list[NodeInfo]) -> bool:
    """A selective region needs a node to keep (``NodeInfo.keepable``), and must not overwrite
    what it keeps: the recomputation reads the kept output as the forward made it."""
    heavy = {n.name for n in nodes if n.keepable}
    return bool(heavy) and not any(n.mutates in heavy for n in nodes)


def _light_allowed(nodes: list[NodeInfo], last_write: dict[str, int] | None = None,
                   end: int = 0) -> bool:
    """A light region needs a light node to recompute and another to keep, and its recomputation
    must read what the forward read: no node of it overwrites a value a light node reads after
    the light node read it (the kept value holds what was written; the forward read it before),
    no kept node overwrites a light node's output (the recomputation rebuilds it unwritten), and
    no node after it overwrites a value it made that a light node reads (``last_write``: value ->
    index of the last node overwriting it, ``end``: the index after the region's last node;
    autograd would refuse the kept value in backward).
    A light region that keeps what a selective one keeps is that region: not offered twice."""
    light = [i for i, n in enumerate(nodes) if n.light]
    if not light or len(light) == len(nodes):
        return False
    if {n.name for n in nodes if not n.light} == {n.name for n in nodes if n.keepable}:
        return False
    recomputed = {nodes[i].name for i in light}
    made = {n.name for n in nodes}
    if last_write and any(last_write.get(v, -1) >= end for i in light for v in nodes[i].reads
                          if v in made and v not in recomputed):
        return False
    for j, node in enumerate(nodes):
        if node.mutates is None:
            continue
        if node.mutates in recomputed or any(
                node.mutates in nodes[i].reads for i in light if i < j):
            return False
    return True


def _arcs(problem: CheckpointProblem, starts: list[int], max_region_atoms: int,
          modes: tuple[str, ...]) -> list[list[_Arc]]:
    """Arcs leaving each boundary: one normal atom, and region runs of up to max atoms."""
    bounds = starts + [len(problem.nodes)]
    leaving: list[list[_Arc]] = [[] for _ in bounds]
    floor = problem.backward_floor()
    last_write = {n.mutates: i for i, n in enumerate(problem.nodes) if n.mutates is not None}
    for a in range(len(starts)):
        leaving[a].append(_arc(problem, bounds[a], bounds[a + 1], NORMAL))
        for b in range(a + 1, min(a + max_region_atoms, len(starts)) + 1):
            nodes = problem.nodes[bounds[a]:bounds[b]]
            if not _region_allowed(nodes, problem.regions_across_blocks):
                break
            for mode in modes:
                if mode == SELECTIVE and not _selective_allowed(nodes):
                    continue
                if mode == LIGHT and not _light_allowed(nodes, last_write, bounds[b]):
                    continue
                leaving[a].append(_arc(problem, bounds[a], bounds[b], mode, floor))
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
                     buckets: int = 2048, modes: tuple[str, ...] = MODES
                     ) -> CheckpointPlan | None:
    """The least-recompute plan whose modelled memory fits ``budget`` bytes; None if none does.

    Kept memory is discretised into ``buckets`` levels (``_solve``); a plan that the exact
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
    starts, leaving, long_lived, pending, boundary_of = _prepared(problem, max_region_atoms,
                                                                  modes)
    # The levels span what can be kept, not the whole budget: most of a budget can be the
    # backward floor (resnet152 at batch 1: 230 of 242 MB are parameter gradients), and levels
    # of budget / buckets were then too coarse to tell apart the plans that fit from those that
    # do not (a budget was refused while a lower one was met).
    unit = max(min(budget, _kept_bound(problem)), 1) / buckets
    search = _Search(problem, pending, boundary_of, long_lived, unit, buckets, budget)
    search.open(0, frozenset()).cost[0] = 0.0
    for k, arcs in enumerate(leaving[:-1]):
        for state, table in list(search.tables[k].items()):
            reachable = np.nonzero(np.isfinite(table.cost))[0]
            for arc in arcs if reachable.size else ():
                search.relax(arc, k, state, table, reachable)
    # The cheapest ends first (ties: less memory, then the state met first): the first whose
    # exact count fits is the plan. The DP's own count is exact or over (values it does not
    # track are charged again), so the first fits unless a plan kept more than the levels span.
    ends = sorted((float(table.cost[m]), int(m), order, state)
                  for order, (state, table) in enumerate(search.tables[len(starts)].items())
                  for m in np.nonzero(np.isfinite(table.cost))[0])
    plan = None
    for _cost, m, _order, state in ends[:_CHECKED_ENDS]:
        regions = search.trace_back(len(starts), state, m)
        candidate = CheckpointPlan(regions=regions,
                                   extra_seconds=sum(r.extra_seconds for r in regions))
        candidate.kept_bytes = modelled_bytes(problem, candidate)
        if plan is None:
            plan = candidate  # over budget: plan_checkpoints re-solves with the excess removed
        if candidate.kept_bytes <= budget:
            plan = candidate
            break
    if plan is not None:
        plan.solve_seconds = time.perf_counter() - started
    return plan


def _prepared(problem: CheckpointProblem, max_region_atoms: int, modes: tuple[str, ...]
              ) -> tuple[list[int], list[list[_Arc]], set[str], list[frozenset[str]],
                         dict[int, int]]:
    """What a solve starts from whatever its budget: the atoms, the arcs leaving each boundary,
    the long-lived values, the values tracked at each boundary, and each boundary's atom. A
    search solves one problem a dozen times or more (the least-memory bisection, the re-solving
    rounds), and the arcs are most of a solve (GhostNetV3's 4,301 nodes: about a second each):
    kept on the problem, made again when any field the solver reads has changed since."""
    key = (max_region_atoms, tuple(modes), problem.regions_across_blocks, problem.region_seconds,
           problem.saved_seconds, tuple(map(id, problem.nodes)),
           tuple(problem.value_bytes.items()))
    found = problem._prepared.get(key)
    if found is not None:
        return found
    starts = atom_starts(problem)
    leaving = _arcs(problem, starts, max_region_atoms, modes)
    produced, last = _lifetimes(problem, starts)
    long_lived = {v for v in problem.value_bytes if v in produced
                  and last.get(v, produced[v]) - produced[v] > _SHORT_LIVED_ATOMS}

    def pending_at(k: int) -> frozenset[str]:
        live = [v for v, p in produced.items()
                if p < k <= last.get(v, -1) and v not in long_lived]
        live.sort(key=lambda v: -problem.value_bytes[v])
        return frozenset(live[:_MAX_TRACKED_PENDING])

    pending = [pending_at(k) for k in range(len(starts) + 1)]
    boundary_of = {pos: k for k, pos in enumerate(starts + [len(problem.nodes)])}
    problem._prepared.clear()  # one entry: the problem's current state
    problem._prepared[key] = found = (starts, leaving, long_lived, pending, boundary_of)
    return found


def _kept_bound(problem: CheckpointProblem) -> int:
    """At least what any plan keeps: every value and every internal saved tensor."""
    return sum(problem.value_bytes.values()) + sum(n.internal_bytes for n in problem.nodes)


@dataclass
class _Table:
    """Least cost per memory bucket at one (boundary, state), with back-pointers and the exact
    bytes the path to each bucket keeps (the bucket is only its level: feasibility is decided on
    the exact bytes, so rounding neither refuses a plan that fits nor accepts one that does not).
    """

    cost: np.ndarray
    from_bucket: np.ndarray
    from_arc: np.ndarray
    kept: np.ndarray


class _Search:
    def __init__(self, problem, pending, boundary_of, long_lived, unit, buckets, budget):
        self.problem, self.pending, self.boundary_of = problem, pending, boundary_of
        self.long_lived, self.unit, self.buckets, self.budget = long_lived, unit, buckets, budget
        self.tables: list[dict[frozenset[str], _Table]] = [dict() for _ in pending]
        self.arcs: list[tuple[_Arc, int, frozenset[str]]] = []
        self.floor = problem.backward_floor()

    def open(self, k: int, state: frozenset[str]) -> _Table:
        if state not in self.tables[k]:
            # headroom above the top level: levels drift from the exact bytes by the rounding of
            # each arc's charge, and a path that fits must not fall off the table
            n = self.buckets + self.buckets // 4 + 1
            self.tables[k][state] = _Table(np.full(n, np.inf), np.full(n, -1), np.full(n, -1),
                                           np.zeros(n, dtype=np.int64))
        return self.tables[k][state]

    def relax(self, arc: _Arc, k: int, state: frozenset[str], table: _Table,
              reachable: np.ndarray) -> None:
        """Extend every reachable memory level at (k, state) by ``arc``."""
        charge, need = self._charge(arc, state)
        step = int(round(charge / self.unit))
        src = reachable[(table.kept[reachable] + need <= self.budget)
                        & (reachable + step < table.cost.size)]
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
        target.kept[dst[better]] = table.kept[src[better]] + charge

    def _charge(self, arc: _Arc, state: frozenset[str]) -> tuple[int, int]:
        """(bytes this arc adds to what is kept, the most it needs on top of what was kept).

        In backward, when a node is reached the plan-independent floor (parameter gradients,
        activation gradients in flight) is alive too; a region also needs what it rebuilds
        (``_arc``: ``backward``). Long-lived values are charged once, by the arc that produces
        them.
        """
        values = self.problem.value_bytes
        if arc.mode != NORMAL:
            charge = arc.internal + sum(values[v] for v in arc.keeps
                                        if v not in state and v not in self.long_lived)
            charge += sum(values[n.name] for n in self.problem.nodes[arc.lo:arc.hi]
                          if n.name in self.long_lived)
            return charge, charge + arc.backward
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
                regions.append(make_region(self.problem, arc.lo, arc.hi, arc.mode, arc.seconds,
                                           arc.working, freed))
        return sorted(regions, key=lambda r: r.start)


def modelled_bytes(problem: CheckpointProblem, plan: CheckpointPlan) -> int:
    """Peak kept bytes of ``plan`` under the solver's model, with the union computed exactly.

    The maximum of: everything kept at the end of forward, at each node run normally what is
    kept up to it plus the backward floor there, and for each region the bytes kept by the nodes
    before it (and by itself) plus what its backward needs (``_arc``: ``backward``).
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
            arc = _arc(problem, region.start, region.stop, region.mode, floor)
            kept |= arc.keeps
            internal += arc.internal
            now = sum(problem.value_bytes[v] for v in kept) + internal
            peak = max(peak, now + arc.backward)
            i = region.stop
        else:
            node = problem.nodes[i]
            kept |= node.saved & problem.value_bytes.keys()
            internal += node.internal_bytes
            now = sum(problem.value_bytes[v] for v in kept) + internal
            peak = max(peak, now + floor[i])
            i += 1
    return max(peak, sum(problem.value_bytes[v] for v in kept) + internal)
