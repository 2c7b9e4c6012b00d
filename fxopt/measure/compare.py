"""Before/after memory figures of an optimization: the peak rows of ``fxopt optimize``'s table.

``figures_of(module, inputs, seconds)`` gives a module's measured peaks of a training step and
of inference (``fxopt.measure``: exact live-storage tracking on CPU, the caching allocator on
CUDA), baseline of parameters, buffers and inputs included, and its predicted peaks
(``fxopt.analysis.estimate_peak``: a fake-tensor run, no compute), so a reader sees how far the
prediction the passes planned with is from the measurement. ``Comparison`` holds two of them;
``fxopt.bench.before_after`` adds the step times and prints the table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from fxopt.analysis import estimate_peak
from fxopt.core.errors import InputError
from fxopt.measure.peaks import format_bytes, measure


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

    def peak_rows(self) -> list[str]:
        """A row per peak, measured and predicted, training and inference: before, after and
        the change."""
        rows = []
        for label, key in (("train peak, measured", "train_measured"),
                           ("train peak, predicted", "train_predicted"),
                           ("inference peak, measured", "inference_measured"),
                           ("inference peak, predicted", "inference_predicted")):
            b, a = getattr(self.before, key), getattr(self.after, key)
            rows.append(f"  {label:<30}{format_bytes(b):>12}{format_bytes(a):>12}"
                        f"{percent_change(b, a):>9}")
        return rows


def percent_change(before: float, after: float) -> str:
    """``+12.3%``: ``after`` against ``before`` (``n/a`` when ``before`` is 0)."""
    return f"{(after / before - 1) * 100:+.1f}%" if before else "n/a"


def figures_of(module: nn.Module, inputs: tuple, seconds: float,
               predicted_instead: Any = None) -> tuple[Figures, Any]:
    """``module``'s measured and predicted peaks with ``seconds`` per step, and the measurement.

    ``predicted_instead``: a ``PeakEstimate`` to use when ``module`` itself cannot run on fake
    tensors (a model with a data-dependent submodule: its captured module, where that submodule
    replays a real run, was predicted instead)."""
    measured = measure(module, inputs)
    try:
        predicted = estimate_peak(module, inputs)
    except InputError:
        if predicted_instead is None:
            raise
        predicted = predicted_instead
    return Figures(measured.train.peak_bytes, predicted.train_bytes,
                   measured.inference.peak_bytes, predicted.inference_bytes, seconds), measured

