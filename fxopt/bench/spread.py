"""Step times with their spread, and whether a change between two models exceeds the noise.

``alternated_step_times(modules, inputs, repeats)`` times training steps (forward + backward,
gradients cleared first, CUDA synchronized around each step) of several models in rounds, the
order rotating each round, after one warm-up step each: every model's samples come from the same
stretch of machine noise, so their medians can be compared. It runs at least ``repeats`` rounds,
and more (up to ``max_repeats``) until every model has run for ``min_seconds``: a millisecond step
needs many samples for a median that noise does not move.

``StepTimes`` keeps the samples (fastest, median, slowest); ``TimeChange`` compares two and says
whether the change of the medians is *within noise*: the larger relative spread of the two
exceeds the size of the change. The spread is ``(slowest - fastest) / median`` for fewer than 20
samples; for more, the middle 80% of the samples over the median (``StepTimes.spread``), as one
outlier among hundreds of millisecond steps would otherwise flag every figure. A figure within
noise is printed with a ``?`` and a sentence saying so, never as a bare percentage.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fxopt.measure.timing import alternated_samples


ALL_SAMPLES_BELOW = 20


@dataclass(frozen=True)
class StepTimes:
    """The timed samples of one model, in seconds."""

    samples: tuple[float, ...]

    @property
    def fastest(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def slowest(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """The width of the samples over their median: 0.5 means they span half the median.
        Fewer than ``ALL_SAMPLES_BELOW`` samples: fastest to slowest. More: the middle 80% (the
        fastest and slowest tenth left out), so that one outlier among hundreds of millisecond
        steps does not make every figure noise."""
        if not self.median:
            return 0.0
        if len(self.samples) < ALL_SAMPLES_BELOW:
            return (self.slowest - self.fastest) / self.median
        deciles = statistics.quantiles(self.samples, n=10, method="inclusive")
        return (deciles[-1] - deciles[0]) / self.median

    def as_dict(self) -> dict[str, Any]:
        return {"samples": len(self.samples), "fastest_seconds": self.fastest,
                "median_seconds": self.median, "slowest_seconds": self.slowest,
                "spread": self.spread}


@dataclass(frozen=True)
class TimeChange:
    """``after`` against ``before``: the ratio of medians, and whether it is within noise."""

    before: StepTimes
    after: StepTimes

    @property
    def ratio(self) -> float:
        return self.after.median / self.before.median if self.before.median else float("nan")

    @property
    def change(self) -> float:
        return self.ratio - 1

    @property
    def noise(self) -> float:
        return max(self.before.spread, self.after.spread)

    @property
    def within_noise(self) -> bool:
        return self.noise > abs(self.change)

    def percent(self) -> str:
        """``"+14.5%"``, or ``"+14.5%?"`` when within noise (see ``noise_line``)."""
        return f"{self.change * 100:+.1f}%" + ("?" if self.within_noise else "")

    def noise_line(self, what: str = "the step-time change") -> str:
        """A sentence saying the change is within noise, or "" when it is not."""
        if not self.within_noise:
            return ""
        return (f"? {what} ({self.change * 100:+.1f}%) is within this run's noise: a model's "
                f"step times spread by up to {self.noise * 100:.0f}% of their median; rerun on "
                "a quiet machine, with more --repeats or with --threads N")

    def as_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "change": self.change, "noise": self.noise,
                "within_noise": self.within_noise}


def alternated_step_times(modules: Sequence[nn.Module], inputs: tuple, repeats: int, *,
                          min_seconds: float = 1.0, max_repeats: int = 200) -> list[StepTimes]:
    """Samples of a training step of each of ``modules``, timed in rotating order
    (``fxopt.measure.timing.alternated_samples``)."""
    return [StepTimes(tuple(samples)) for samples in alternated_samples(
        modules, inputs, repeats, min_seconds=min_seconds, max_repeats=max_repeats)]
