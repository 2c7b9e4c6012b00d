"""The Report an optimized module carries as ``.fxopt_report``, and its table form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxopt.capture.trace import TraceInfo
from fxopt.measure.peaks import MemoryReport, format_bytes
from fxopt.rewrite.pipeline import PassRecord
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "trace": {
                "seconds": self.trace.seconds,
                "leaves": [vars(leaf) for leaf in self.trace.leaves],
                "frontend": self.trace.frontend,
                "not_used": {name: why for name, why in self.trace.not_used},
            },
            "passes": [p.as_dict() for p in self.passes],
            "verification": self.verification.as_dict() if self.verification else None,
            "memory_before": _memory_dict(self.memory_before),
            "memory_after": _memory_dict(self.memory_after),
        }

    def __str__(self) -> str:
        lines = [f"fxopt report for {self.model}"]
        lines.append(f"  captured by {_FRONTENDS.get(self.trace.frontend, self.trace.frontend)} "
                     f"in {self.trace.seconds:.2f} s"
                     + (f"; {len(self.trace.leaves)} submodule(s) kept as opaque leaves:"
                        if self.trace.leaves else "; fully traced"))
        for leaf in self.trace.leaves:
            lines.append(f"    {leaf.path} ({leaf.module_type}): {leaf.reason}")
        for name, why in self.trace.not_used:
            lines.append(f"    {name} not used: {why}")
        if not self.passes:
            lines.append("  passes: none ran")
        for record in self.passes:
            stats = ", ".join(f"{k}={v}" for k, v in record.stats.items() if not isinstance(v, (list, dict)))
            lines.append(f"  {record.name:<22} {'changed' if record.modified else 'unchanged':<9} "
                         f"{record.seconds * 1e3:7.1f} ms  {stats}")
            lines.extend(_region_lines(record.stats.get("regions", [])))
            lines.extend(_padded_op_lines(record.stats.get("ops", [])))
        if self.memory_before and self.memory_after:
            lines.append(memory_table(self.memory_before, self.memory_after))
        if self.verification is not None:
            lines.append(f"  verification: {self.verification}")
        return "\n".join(lines)


def _region_lines(regions: list[dict[str, Any]]) -> list[str]:
    """One line per recomputed region: span, mode, predicted extra time and memory saved."""
    return [
        f"    {r['region']:<18} {r['mode']:<9} {r['nodes']:>3} nodes  {r['first']} .. {r['last']}: "
        f"keeps {format_bytes(r['kept_bytes_saved'])} less, rebuilds "
        f"{format_bytes(r['rebuilt_bytes'])} in backward, +{r['predicted_extra_ms']:.2f} ms predicted"
        for r in regions if "kept_bytes_saved" in r
    ]


def _padded_op_lines(ops: list[dict[str, Any]]) -> list[str]:
    """One line per op pad_channels padded: old -> new shapes and the FLOPs it adds."""
    return [f"    {op['node']:<18} {op['old']}  =>  {op['new']}  (+{op['extra_flops']:,} FLOPs)"
            for op in ops if "old" in op and "new" in op]


def _memory_dict(report: MemoryReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"train": report.train.as_dict(), "inference": report.inference.as_dict()}


def memory_table(before: MemoryReport, after: MemoryReport) -> str:
    """Before/after peak memory, total and above the baseline (params, buffers, inputs)."""
    rows = [f"  {'measured peak':<28}{'before':>12}{'after':>12}{'saved':>9}"]
    for label, b, a in (
        ("train step (total)", before.train.peak_bytes, after.train.peak_bytes),
        ("train step (above baseline)", before.train.step_peak_bytes, after.train.step_peak_bytes),
        ("inference (total)", before.inference.peak_bytes, after.inference.peak_bytes),
        ("inference (above baseline)", before.inference.step_peak_bytes,
         after.inference.step_peak_bytes),
    ):
        saved = f"{(1 - a / b) * 100:7.1f}%" if b else "    n/a"
        rows.append(f"  {label:<28}{format_bytes(b):>12}{format_bytes(a):>12}{saved:>9}")
    rows.append(f"  (device: {before.train.device}; method: {before.train.method})")
    return "\n".join(rows)
