"""The before/after table ``fxopt optimize`` prints: peaks measured and predicted, step times with
their spread.

``before_after(model, optimized, inputs, repeats)`` returns a ``BeforeAfter``: the
``fxopt.measure.compare.Comparison`` figures (measured peaks: exact live-storage tracking on CPU,
the caching allocator on CUDA; predicted peaks from ``estimate_peak``) and the step times of both
models alternated in one run (``fxopt.bench.spread``), with fastest, median and slowest, and the
change flagged when it is within the run's noise.

Every peak is the whole training step or inference forward: parameters, buffers and inputs
included (``PEAK_DEFINITION``, the same definition ``fxopt bench`` uses). Everything runs under
``preserved_state``: grads, buffers, training flags and the RNG are as before.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxopt.bench.spread import StepTimes, TimeChange, alternated_step_times
from fxopt.core.step import as_args
from fxopt.measure.compare import Comparison, figures_of

PEAK_DEFINITION = "the whole step, parameters, buffers and inputs included"


@dataclass(frozen=True)
class BeforeAfter:
    comparison: Comparison
    times: TimeChange
    threads: int

    def as_dict(self) -> dict[str, Any]:
        return {**self.comparison.as_dict(), "peak_definition": PEAK_DEFINITION,
                "step_times": {"before": self.times.before.as_dict(),
                               "after": self.times.after.as_dict(), **self.times.as_dict()},
                "torch_threads": self.threads}

    def __str__(self) -> str:
        rows = [f"  {'':<30}{'before':>12}{'after':>12}{'change':>9}",
                *self.comparison.peak_rows(), *_step_rows(self.times)]
        device = self.comparison.device
        if not device.startswith("cuda"):
            device += f", {self.threads} torch thread{'s' if self.threads != 1 else ''}"
        rows.append(f"  (device: {device}; peaks: {PEAK_DEFINITION},")
        rows.append(f"   measured by {self.comparison.method}, predicted on fake tensors;")
        rows.append("   step times: training steps alternated with the original in one run)")
        if self.times.within_noise:
            rows += ["  " + line for line in textwrap.wrap(self.times.noise_line(), 96)]
        return "\n".join(rows)


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with three or four significant digits: ``"0.512 ms"``."""
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 100 else f"{ms:.2f} ms" if ms >= 10 else f"{ms:.3f} ms"


def _step_rows(times: TimeChange) -> list[str]:
    """Fastest, median (with the change) and slowest step of each model, in ms."""
    count = min(len(times.before.samples), len(times.after.samples))
    rows = []
    for label, pick, change in (("fastest", StepTimes.fastest, ""),
                                ("median", StepTimes.median, times.percent()),
                                ("slowest", StepTimes.slowest, "")):
        b, a = pick.fget(times.before), pick.fget(times.after)
        rows.append(f"  {f'train step, {label} of {count}':<30}{format_ms(b):>12}"
                    f"{format_ms(a):>12}{change:>9}".rstrip())
    return rows


def before_after(model: nn.Module, optimized: nn.Module, example_inputs: Any, *,
                 repeats: int = 5) -> BeforeAfter:
    """Measured and predicted peaks of ``model`` and ``optimized``, and their step times."""
    inputs = as_args(example_inputs)
    original, variant = alternated_step_times([model, optimized], inputs, repeats)
    report = getattr(optimized, "fxopt_report", None)  # the captured module's own prediction
    before, measured = figures_of(model, inputs, original.median,
                                  getattr(report, "predicted_before", None))
    after, _ = figures_of(optimized, inputs, variant.median)
    comparison = Comparison(before, after, measured.train.device, measured.train.method,
                            len(original.samples))
    return BeforeAfter(comparison, TimeChange(original, variant), torch.get_num_threads())
