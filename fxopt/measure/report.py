"""The Report an optimized module carries as ``.fxopt_report``, and its table form."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import fx

from fxopt.core import progress
from fxopt.analysis.estimate import PeakEstimate, estimate_peak
from fxopt.core.graphs import placeholder_values
from fxopt.capture.trace import TraceInfo
from fxopt.core.errors import InputError
from fxopt.core.step import FROM_LOSS
from fxopt.measure.peaks import MemoryReport, format_bytes
from fxopt.rewrite.pass_base import stats_lines
from fxopt.rewrite.pipeline import PassRecord
from fxopt.core.training_setup import TrainingSetup
from fxopt.measure.budget_check import BudgetCheck
from fxopt.verify.equivalence import VerifyReport

_FRONTENDS = {"fx": "fx (symbolic tracing)", "export": "export (torch.export)"}


@dataclass
class Report:
    model: str
    trace: TraceInfo
    passes: list[PassRecord] = field(default_factory=list)
    verification: VerifyReport | None = None
    memory_before: MemoryReport | None = None
    memory_after: MemoryReport | None = None
    predicted_before: PeakEstimate | str | None = None  # str: why there is no prediction
    predicted_after: PeakEstimate | str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds
    training: TrainingSetup | None = None  # the training step planned for
    verified_where: str = ""  # where verification ran (``fxopt.verify.fitting``)
    budget_check: BudgetCheck | None = None  # the planned module's real peak against the budget
    # fake-tensor predictions of a step: {"run": made, "remembered": answered from memory}
    predictions: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "trace": {
                "seconds": self.trace.seconds,
                "leaves": [vars(leaf) for leaf in self.trace.leaves],
                "frontend": self.trace.frontend,
                "not_used": {name: why for name, why in self.trace.not_used},
                "leaf_runs": list(getattr(self.trace, "leaf_runs", ())),
            },
            "passes": [p.as_dict() for p in self.passes],
            "verification": self.verification.as_dict() if self.verification else None,
            "memory_before": _memory_dict(self.memory_before),
            "memory_after": _memory_dict(self.memory_after),
            "predicted_before": _predicted_dict(self.predicted_before),
            "predicted_after": _predicted_dict(self.predicted_after),
            "seconds": {**self.seconds, "total": self.total_seconds},
            "training": self.training.describe() if self.training else None,
            "verified_where": self.verified_where,
            "budget_check": (None if self.budget_check is None else
                             {"budget_bytes": self.budget_check.budget_bytes,
                              "rounds": self.budget_check.rounds,
                              "device": self.budget_check.device}),
            "predictions": dict(self.predictions),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a Report pickled by an earlier fxopt lacks the fields added since
        self.__dict__.update({"seconds": {}, "training": None, "verified_where": "",
                              "budget_check": None, "predictions": {}, **state})

    @property
    def total_seconds(self) -> float:
        """Wall time of ``optimize`` (capture, prediction, passes, verification, measurement)."""
        return sum(self.seconds.values())

    def __str__(self) -> str:
        lines = [f"fxopt report for {self.model}"]
        traces = getattr(self.trace, "traces", 0)
        lines.append(f"  captured by {_FRONTENDS.get(self.trace.frontend, self.trace.frontend)} "
                     f"in {f'{traces} traces, ' if traces else ''}{self.trace.seconds:.2f} s"
                     + (" (by fxopt.capture_model, reused)" if getattr(self.trace, "reused", False)
                        else "")
                     + (f"; {len(self.trace.leaves)} submodule(s) kept as opaque leaves:"
                        if self.trace.leaves else "; fully traced"))
        if getattr(self.trace, "sizes", ""):
            lines.append(f"    {self.trace.sizes}")
        for leaf in self.trace.leaves:
            lines.append(f"    {leaf.path} ({leaf.module_type}): {leaf.reason}")
        lines.extend(f"    {line}" for line in getattr(self.trace, "leaf_runs", ()))
        for name, why in self.trace.not_used:
            lines.append(f"    {name} not used: {why}")
        if self.training is not None:
            lines.append(f"  planned for a training step on {self.training.describe()}")
        if not self.passes:
            lines.append("  passes: none ran")
        for record in self.passes:
            stats = ", ".join(f"{k}={_stat(k, v)}" for k, v in record.stats.items()
                              if not isinstance(v, (list, dict)))
            lines.append(f"  {record.name:<22} {'changed' if record.modified else 'unchanged':<9} "
                         f"{record.seconds * 1e3:7.1f} ms  {stats}")
            lines.extend("    " + line for line in stats_lines(record.stats))
        table = peaks_table(self.predicted_before, self.predicted_after, self.memory_before,
                            self.memory_after)
        if table:
            lines.append(table)
        if self.budget_check is not None:
            lines.append(f"  budget check: {self.budget_check}")
        if self.verification is not None:
            where = f"; ran at {self.verified_where}" if self.verified_where else ""
            lines.append(f"  verification: {self.verification}{where}")
        if self.seconds:
            phases = ", ".join(f"{name} {value:.2f}" for name, value in self.seconds.items())
            lines.append(f"  time: {self.total_seconds:.2f} s ({phases})" + _predictions_line(
                self.predictions))
        return "\n".join(lines)


def _predictions_line(predictions: dict[str, int]) -> str:
    if not predictions.get("run"):
        return ""
    remembered = predictions.get("remembered", 0)
    return (f"; {predictions['run']} fake-tensor prediction(s) of a step"
            + (f", {remembered} more answered from memory" if remembered else ""))


class PhaseClock:
    """``with clock("verify"): ...`` adds the block's wall seconds to ``clock.seconds``, and
    tells the phase as it happens (``fxopt.core.progress``: the "fxopt" logger, a terminal's
    status line)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            with progress.phase(phase):
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


_BYTE_STATS = ("predicted_before", "predicted_after")


def _stat(key: str, value: Any) -> Any:
    """A pass statistic as the report prints it: sizes in MiB/KiB, the rest as they are."""
    if isinstance(value, int) and (key.endswith("_bytes") or key in _BYTE_STATS):
        return format_bytes(value)
    return value


def _memory_dict(report: MemoryReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"train": report.train.as_dict(), "inference": report.inference.as_dict()}


def predicted_peaks(gm: fx.GraphModule, training: TrainingSetup | None = None
                    ) -> PeakEstimate | str:
    """``estimate_peak`` of ``gm`` on its placeholders' fake values for the training
    ``training`` describes, or why it cannot be had."""
    try:
        return estimate_peak(gm, placeholder_values(gm), training=training)
    except InputError as error:
        return error.what


def _predicted_dict(estimate: PeakEstimate | str | None) -> dict[str, Any] | str | None:
    if not isinstance(estimate, PeakEstimate):
        return estimate
    return {**asdict(estimate), "activation_bytes": estimate.activation_bytes}


def peaks_table(predicted_before: PeakEstimate | str | None, predicted_after: PeakEstimate | str | None,
                measured_before: MemoryReport | None, measured_after: MemoryReport | None) -> str:
    """Before/after peaks as ``fxopt optimize`` prints them: measured rows where measured,
    predicted rows where predicted; totals include parameters, buffers and inputs."""
    rows: list[tuple[str, int, int]] = []
    if measured_before and measured_after:
        rows += [("train peak, measured", measured_before.train.peak_bytes,
                  measured_after.train.peak_bytes),
                 ("  activations at it, measured", measured_before.train.activations_at_peak_bytes,
                  measured_after.train.activations_at_peak_bytes)]
    both = [e for e in (predicted_before, predicted_after) if isinstance(e, PeakEstimate)]
    if len(both) == 2:
        before, after = both
        rows += [("train peak, predicted", before.train_bytes, after.train_bytes),
                 ("  activations at it, predicted", before.activation_bytes, after.activation_bytes),
                 ("  gradients at it, predicted", before.train_grad_bytes, after.train_grad_bytes)]
    if measured_before and measured_after:
        rows.append(("inference peak, measured", measured_before.inference.peak_bytes,
                     measured_after.inference.peak_bytes))
    if len(both) == 2:
        rows.append(("inference peak, predicted", both[0].inference_bytes, both[1].inference_bytes))
    lines = [f"  {'':<32}{'before':>12}{'after':>12}{'change':>9}"] if rows else []
    for label, b, a in rows:
        change = f"{(a / b - 1) * 100:+.1f}%" if b else "n/a"
        lines.append(f"  {label:<32}{format_bytes(b):>12}{format_bytes(a):>12}{change:>9}")
    for label, estimate in (("before", predicted_before), ("after", predicted_after)):
        if isinstance(estimate, str):
            lines.append(f"  no prediction {label}: {estimate}")
    if rows:
        method = (f"measured on {measured_before.train.device} by {measured_before.train.method}; "
                  if measured_before else "")
        lines.append(f"  ({method}predicted on fake tensors; peaks include parameters, buffers "
                     "and inputs;\n   activations: the peak minus those, and minus the "
                     "parameter gradients\n   and any fused optimizer step's temporaries alive "
                     "at it)")
    if rows and FROM_LOSS in (*(e.train_backward_from for e in both),
                              *(m.train.backward_from for m in (measured_before, measured_after)
                                if m is not None)):
        lines.append(f"  training step: backward from {FROM_LOSS} alone, as loss.backward() "
                     "(the other outputs\n   get no cotangent; they are held through backward, as "
                     "by out = model(...))")
    fused = next((e for e in both if e.fused_parameters), None)
    if fused is not None:
        lines.append(f"  fused optimizer step: {fused.fused_parameters} parameters stepped in "
                     "backward, each gradient freed at its step (predicted with the step's own "
                     f"temporaries); optimizer state {format_bytes(fused.optimizer_state_bytes)}, "
                     "alive throughout, not in the peaks"
                     + ("; measured rows ran with the fused step paused (fxopt's runs never "
                        "update parameters): fxopt.verify_fused_training(measure_memory=True) "
                        "measures it" if measured_before else ""))
    return "\n".join(lines)
