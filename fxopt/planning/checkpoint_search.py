"""The search around the checkpoint solver: a plan whose *predicted* peak fits the budget, at the
least recompute time.

The solver (``fxopt.planning.solver``) plans against its own memory model; the last word is
``estimate_peak``'s fake-tensor run of the rewritten forward and backward, which the caller
supplies as ``predict(plan) -> bytes`` (it applies the plan to a copy of the graph). The search:

1. solves with the budget left after what the solver does not model (``overhead``); when the
   prediction overshoots, lowers the solver's budget by the overshoot and solves again, up to
   ``max_rounds`` times;
2. if no round fits, finds the least-memory plan (``least_memory_plan``: of several candidates,
   the one with the least *predicted* peak) and, when that fits, bisects between it and the last
   failing budget for the largest fitting budget: the plan that recomputes least among those
   that fit;
3. if even the least-memory plan does not fit, raises ``BudgetError`` with the smallest predicted
   peak, which a user can pass back as the budget.

Every plan is predicted once (``Predictions``), and ties between equal predictions are broken by
recompute time and then by the regions' places in the graph, never by the order of a set: the
same problem gives the same plan in every process.

Decision only: no graph is edited here.
"""

from __future__ import annotations

from collections.abc import Callable

from fxopt.core.errors import BudgetError
from fxopt.planning.solver import (
    CheckpointPlan,
    CheckpointProblem,
    block_plan,
    plan_checkpoints,
)

Predict = Callable[[CheckpointPlan], int]
Predicted = tuple[int, CheckpointPlan]

LEAST_MEMORY_CANDIDATES = 4  # the solver's plans of least modelled memory that are predicted


def plan_key(plan: CheckpointPlan) -> tuple[tuple[int, int, str], ...]:
    """The plan's regions in graph order: equal keys, equal plans."""
    return tuple((r.start, r.stop, r.mode) for r in plan.regions)


def _rank(found: Predicted) -> tuple:
    """Least predicted peak first; then less recompute, fewer regions, earlier in the graph."""
    peak, plan = found
    return peak, plan.extra_seconds, len(plan.regions), plan_key(plan)


class Predictions:
    """``predict`` with a memory: each distinct plan is predicted once (a prediction is a
    fake-tensor run of the rewritten forward and backward), and every plan predicted so far is
    a candidate for the least-memory plan."""

    def __init__(self, predict: Predict):
        self.predict = predict
        self.seen: dict[tuple, Predicted] = {}

    def __call__(self, plan: CheckpointPlan) -> int:
        key = plan_key(plan)
        if key not in self.seen:
            self.seen[key] = (self.predict(plan), plan)
        return self.seen[key][0]


def search_plan(problem: CheckpointProblem, *, target: int, unoptimized_peak: int,
                predict: Predict, max_region_atoms: int = 16, max_rounds: int = 6,
                where: str = "checkpoint pass", activations: int | None = None,
                gradients: int = 0) -> Predicted:
    """(predicted peak, plan) of the cheapest plan predicted to fit ``target`` bytes.

    ``gradients``: parameter gradients alive at the unoptimized peak that a fused optimizer
    step would free (0 when there are none, or they are freed already); when they are a large
    part of the peak, a ``BudgetError`` suggests fusing."""
    predict = predict if isinstance(predict, Predictions) else Predictions(predict)
    overhead = unoptimized_peak - problem.kept_without_checkpointing()
    solver_budget = target - overhead
    best: Predicted | None = None
    for _round in range(max_rounds):
        plan = plan_checkpoints(problem, solver_budget, max_region_atoms=max_region_atoms)
        if plan is None:
            break
        predicted = predict(plan)
        if best is None or predicted < best[0]:
            best = (predicted, plan)
        if predicted <= target:
            return best
        solver_budget -= predicted - target
    smallest = least_memory_plan(problem, predict, max_region_atoms)
    if smallest is not None and smallest[0] <= target:
        return _cheapest_fitting(problem, predict, target, smallest, target - overhead,
                                 max_region_atoms)
    smallest_peak = smallest[0] if smallest else unoptimized_peak
    raise unreachable_budget(target, smallest_peak, unoptimized_peak, where=where,
                             activations=activations, gradients=gradients)


def unreachable_budget(target: int, smallest_peak: int, unoptimized_peak: int, *, where: str,
                       activations: int | None = None, gradients: int = 0) -> BudgetError:
    """The ``BudgetError`` for ``target`` bytes when the least predicted peak any plan reaches
    is ``smallest_peak``."""
    fraction = ""
    if activations:
        fraction = (f", a fraction {1 - (unoptimized_peak - smallest_peak) / activations:.3f} "
                    "of the activation memory")
    return BudgetError(
        f"memory budget {_mib(target)} ({target:,} bytes) cannot be met: the smallest "
        f"predicted training peak this pass reaches is {_mib(smallest_peak)} "
        f"({smallest_peak:,} bytes{fraction}; unoptimized: {_mib(unoptimized_peak)})",
        where=where,
        hint=f"pass memory_budget='min' for that least-memory plan, or a budget of at least "
             f"{smallest_peak} (bytes), or lower the batch size" + _fusing_hint(
                 gradients, unoptimized_peak),
        smallest_bytes=smallest_peak,
    )


def _fusing_hint(gradients: int, peak: int) -> str:
    if gradients < peak // 4:
        return ""
    return (f"; {_mib(gradients)} of the unoptimized peak are parameter gradients, which "
            "checkpointing cannot free: fuse the optimizer step into backward "
            "(optimize(..., fused_optimizer=fxopt.fuse_optimizer(...)); on the command line "
            "--fuse-optimizer NAME) "
            "and each is freed at its step")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def least_memory_plan(problem: CheckpointProblem, predict: Predict,
                      max_region_atoms: int) -> Predicted | None:
    """(predicted peak, plan) of the plan with the least predicted peak among: the distinct
    plans of least modelled memory the solver gives while its budget is bisected down to the
    least it can meet (``LEAST_MEMORY_CANDIDATES`` of them), one full region per repeated block
    (``solver.block_plan``), and every plan ``predict`` has predicted already (a
    ``Predictions``: the re-solving rounds of ``search_plan``).

    Several, because the solver's model is not the prediction: plans it counts as equal, or
    within a few percent, differ in their predicted peaks (the GPT of
    tests/test_export_frontend.py: 303,872 and 312,192 bytes), and the least modelled is not
    always the least predicted."""
    predictions = predict if isinstance(predict, Predictions) else Predictions(predict)
    candidates = _solver_least_memory(problem, max_region_atoms)[:LEAST_MEMORY_CANDIDATES]
    blocks = block_plan(problem)
    for plan in candidates + ([blocks] if blocks is not None else []):
        predictions(plan)
    return min(predictions.seen.values(), key=_rank, default=None)


def _solver_least_memory(problem: CheckpointProblem, max_region_atoms: int
                         ) -> list[CheckpointPlan]:
    """The distinct plans met while bisecting the solver's budget down to the least it can
    meet, least modelled memory first (ties: less recompute, then graph order)."""
    low, high = 0, problem.kept_without_checkpointing()
    met: dict[tuple, CheckpointPlan] = {}
    for _ in range(12):
        middle = (low + high) // 2
        plan = plan_checkpoints(problem, middle, max_region_atoms=max_region_atoms)
        if plan is None:
            low = middle + 1
        else:
            met.setdefault(plan_key(plan), plan)
            high = middle
    return sorted(met.values(), key=lambda plan: (plan.kept_bytes, plan.extra_seconds,
                                                  len(plan.regions), plan_key(plan)))


def _cheapest_fitting(problem: CheckpointProblem, predict: Predict, target: int,
                      fitting: Predicted, failing_budget: int, max_region_atoms: int,
                      steps: int = 6) -> Predicted:
    """Between a solver budget whose plan fits ``target`` (``fitting``, the least-memory plan)
    and one whose plan does not, bisect for the largest that fits: it recomputes least.

    Without it a budget just below what the re-solving rounds reach would get the least-memory
    plan, paying for recomputation the budget does not ask for.
    """
    best = fitting
    low, high = fitting[1].kept_bytes, failing_budget
    for _ in range(steps):
        if high - low < 2:
            break
        middle = (low + high) // 2
        plan = plan_checkpoints(problem, middle, max_region_atoms=max_region_atoms)
        predicted = predict(plan) if plan is not None else None
        if predicted is not None and predicted <= target:
            low = middle
            if plan.extra_seconds < best[1].extra_seconds:
                best = (predicted, plan)
        else:
            high = middle
    return best
