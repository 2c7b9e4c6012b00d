"""Before/after figures of an optimization: what ``fxopt optimize`` prints as its table.

``compare(model, optimized, example_inputs)`` gives, for the original and the optimized module:

- the measured peaks of a training step and of inference (``fxopt.measure``: exact live-storage
  tracking on CPU, the caching allocator on CUDA), baseline of parameters, buffers and inputs
  included;
- the predicted peaks (``fxopt.analysis.estimate_peak``: a fake-tensor run, no compute), so a
  reader sees how far the prediction the passes planned with is from the measurement;
- the median training-step time, timed alternately with the original after a warm-up
  (``fxopt.measure.timing.timed_against``), so both medians see the same stretch of machine noise.

Everything runs under ``preserved_state``: grads, buffers, flags and the RNG are as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from fxopt.analysis import estimate_peak
from fxopt.core.step import as_args
from fxopt.measure.peaks import format_bytes, measure
from fxopt.measure.timing import timed_against


@dataclass(frozen=True)
class Figures:
    train_measured: int
    train_predicted: int
    inference_measured: int
    inference_predicted: int
    step_seconds: float


@dataclass(frozen=True)
class Comparison:
    before: Figures
    after: Figures
    device: str
    method: str
    repeats: int

    def as_dict(self) -> dict[str, Any]:
        return {"before": asdict(self.before), "after": asdict(self.after),
                "device": self.device, "method": self.method, "repeats": self.repeats}

    def __str__(self) -> str:
        rows = [f"  {'':<30}{'before':>12}{'after':>12}{'change':>9}"]
        for label, key in (("train peak, measured", "train_measured"),
                           ("train peak, predicted", "train_predicted"),
                           ("inference peak, measured", "inference_measured"),
                           ("inference peak, predicted", "inference_predicted")):
            b, a = getattr(self.before, key), getattr(self.after, key)
            rows.append(f"  {label:<30}{format_bytes(b):>12}{format_bytes(a):>12}"
                        f"{percent_change(b, a):>9}")
        b, a = self.before.step_seconds, self.after.step_seconds
        rows.append(f"  {f'train step, median of {self.repeats}':<30}{b * 1e3:>9.1f} ms"
                    f"{a * 1e3:>9.1f} ms{percent_change(b, a):>9}")
        rows.append(f"  (device: {self.device}; measured by {self.method}; predicted on fake "
                    "tensors; peaks include parameters, buffers and inputs)")
        return "\n".join(rows)


def percent_change(before: float, after: float) -> str:
    """``+12.3%``: ``after`` against ``before`` (``n/a`` when ``before`` is 0)."""
    return f"{(after / before - 1) * 100:+.1f}%" if before else "n/a"


def figures_of(module: nn.Module, inputs: tuple, seconds: float) -> tuple[Figures, Any]:
    """``module``'s measured and predicted peaks with ``seconds`` per step, and the measurement."""
    measured = measure(module, inputs)
    predicted = estimate_peak(module, inputs)
    return Figures(measured.train.peak_bytes, predicted.train_bytes,
                   measured.inference.peak_bytes, predicted.inference_bytes, seconds), measured


def compare(model: nn.Module, optimized: nn.Module, example_inputs: Any, *,
            repeats: int = 5) -> Comparison:
    """Measured and predicted peaks and step times of ``model`` and ``optimized``."""
    inputs = as_args(example_inputs)
    after_seconds, before_seconds = timed_against(model, optimized, inputs, repeats)
    before, measured = figures_of(model, inputs, before_seconds)
    after, _ = figures_of(optimized, inputs, after_seconds)
    return Comparison(before, after, measured.train.device, measured.train.method, repeats)
