"""Measured memory and time, and what fxopt tells the user about them.

- ``peaks``: measured peaks of a training step and of inference (``measure``).
- ``allocations``: the CUDA allocator's peak while a callable runs.
- ``timing``: step times of two models interleaved in one run.
- ``timeline`` / ``breakdown`` / ``plot``: memory over one step, where it goes, drawn to a PNG.
- ``advice``: the review comments memory guides would make about a model (``fxopt report``).
- ``compare`` / ``report``: the before/after table and the Report an optimized module carries.
"""

from fxopt.measure.peaks import (
    MemoryFigure,
    MemoryReport,
    format_bytes,
    measure,
    measure_inference,
    measure_train_step,
)

__all__ = ["MemoryFigure", "MemoryReport", "format_bytes", "measure", "measure_inference",
           "measure_train_step"]
