"""The closing check of a memory budget: the planned module's real peak, before ``optimize`` returns.

Plans are made against predictions on fake tensors. On the CPU those are exact. On a GPU they
miss what fake tensors cannot see (kernel workspaces not measured yet, the caching allocator's
block reuse), so a plan predicted to fit can land over the budget. ``keep_budget`` runs one
real training step of the planned module, as planned (``measure_train_step(training=...)``:
its autocast, fused-step and per-block gradient release), and when the peak is over the
budget it plans again from the captured module, up to ``ROUNDS`` times, for the budget less what
the last plan's prediction missed (its measured peak minus its predicted one): the plan's
predicted peak lowered by its overshoot. Lowering the plan's *budget* by the overshoot instead
can give the same plan again, when the plan peaked below its budget by more than it overshot
(a Llama on the CPU, predictions made to miss 136,065 bytes: the second plan landed 1,538 bytes
over, and the third and fourth were the second). The budget is then what
``torch.cuda.max_memory_allocated`` shows, or a ``BudgetError`` says what the device needs.

For ``memory_budget="min"`` there is nothing to keep: the check measures what the device
really reaches, for the report.

Not handled: a fused optimizer step's own temporaries (the step is paused in fxopt's runs; its
gradients are dropped at accumulation instead) and FSDP2's gathered parameters (one device,
unsharded, is measured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from fxopt.core.errors import BudgetError
from fxopt.core.modules import structural_copy
from fxopt.core.tensors import format_bytes
from fxopt.rewrite.pipeline import Config, PassRecord, run_passes
from fxopt.rewrite.registry import PassRegistry

ROUNDS = 3


@dataclass
class BudgetCheck:
    """What the closing check measured: each plan's budget (bytes given to the planner) and
    the peak one real step of it reached."""

    budget_bytes: int | None        # the budget in bytes (None: "min")
    rounds: list[tuple[int | None, int]] = field(default_factory=list)
    device: str = ""

    @property
    def measured_bytes(self) -> int:
        return self.rounds[-1][1]

    @property
    def kept(self) -> bool:
        return self.budget_bytes is None or self.measured_bytes <= self.budget_bytes

    def __str__(self) -> str:
        measured = f"measured {format_bytes(self.measured_bytes)} on {self.device}"
        if self.budget_bytes is None:
            return f"least memory: {measured}"
        plans = len(self.rounds)
        again = f" after planning {plans} times (each real step over the budget lowered the next)" \
            if plans > 1 else ""
        return f"budget {format_bytes(self.budget_bytes)}: {measured}{again}"


def budget_kept_by(records: list[PassRecord], registry: PassRegistry) -> int | None:
    """The budget in bytes the plan was made for: ``budget_bytes`` of the pass that keeps the
    budget (``PassSpec.budget == "keeps"``), or None."""
    return _kept_figure(records, registry, "budget_bytes")


def _kept_figure(records: list[PassRecord], registry: PassRegistry, key: str) -> int | None:
    """The figure ``key`` (bytes) of the pass that keeps the budget, or None."""
    keepers = {spec.name for spec in registry if spec.budget == "keeps"}
    for record in records:
        if record.name in keepers and isinstance(record.stats.get(key), int):
            return record.stats[key]
    return None


def keep_budget(gm: fx.GraphModule, captured: fx.GraphModule, records: list[PassRecord],
                config: Config, registry: PassRegistry,
                measure: Callable[[fx.GraphModule], int], *, device: str = "",
                minimum: bool = False) -> tuple[fx.GraphModule, list[PassRecord], BudgetCheck]:
    """``gm`` (planned by ``records`` from ``captured``) or a re-plan of ``captured`` whose real
    peak (``measure``) is within the budget; the check's figures. ``minimum``: the budget is
    ``"min"`` (measured, not kept)."""
    target = None if minimum else budget_kept_by(records, registry)
    check = BudgetCheck(target, [(target, measure(gm))], device)
    given = target
    while not check.kept:
        if len(check.rounds) > ROUNDS:
            raise BudgetError(
                f"memory budget {format_bytes(target)} ({target:,} bytes) is not met on "
                f"{device}: after {ROUNDS} plans, each for the budget less what the last one's "
                f"prediction missed, a real step still peaks at "
                f"{format_bytes(check.measured_bytes)} "
                f"({check.measured_bytes:,} bytes)", where="fxopt.optimize, budget check",
                hint="give a lower budget, or memory_budget='min' for the least the device "
                     "reaches", smallest_bytes=check.measured_bytes)
        predicted = _kept_figure(records, registry, "predicted_after")
        planned = given if predicted is None else min(given, predicted)
        given = planned - (check.measured_bytes - target)
        if given < 1:  # the predictions miss more than the budget leaves any plan
            raise BudgetError(
                f"memory budget {format_bytes(target)} ({target:,} bytes) is not met on "
                f"{device}: the plan for it peaks at {format_bytes(check.measured_bytes)} in a "
                f"real step, {format_bytes(check.measured_bytes - planned)} more than predicted, "
                "which leaves no budget to plan for", where="fxopt.optimize, budget check",
                hint="give a larger budget, or memory_budget='min' for the least the device "
                     "reaches", smallest_bytes=check.measured_bytes)
        candidate = structural_copy(captured)
        lowered = Config(passes=config.passes, memory_budget=given, dump_dir=None,
                         training=config.training)
        try:
            records = run_passes(candidate, lowered, registry)
        except BudgetError as error:
            raise BudgetError(
                f"memory budget {format_bytes(target)} ({target:,} bytes) is not met on "
                f"{device}: the plan for it peaks at {format_bytes(check.measured_bytes)} in a "
                f"real step, and no plan reaches the {format_bytes(given)} that would make up "
                f"for the difference: {error.what}", where="fxopt.optimize, budget check",
                hint=error.hint, smallest_bytes=error.smallest_bytes) from error
        gm = candidate
        check.rounds.append((given, measure(gm)))
    return gm, records, check


def check_wanted(option: Any, device_type: str, budget: Any) -> bool:
    """``check_budget=`` as ``optimize`` takes it: None is on where predictions are not exact
    (every device but the CPU) and a budget was given."""
    if budget is None:
        return False
    return device_type != "cpu" if option is None else bool(option)
