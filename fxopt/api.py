"""``fxopt.optimize``: trace, rewrite, verify, (optionally) measure.

The result is a GraphModule that owns the user's Parameter objects (an optimizer built on either
model trains the other), has the same ``state_dict()`` keys, order and shapes (checkpoints load
both ways), and carries its Report as ``.fxopt_report``. The user's model object is never
modified: tracing works on a structural copy, and verification and measurement restore grads,
buffers, training flags and the RNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import fx, nn

from fxopt.measure import measure
from fxopt.pipeline import Config, PassRequest, run_passes
from fxopt.report import Report
from fxopt.step import as_args
from fxopt.trace import trace
from fxopt.verify import verify as run_verify


def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    passes: list[PassRequest] | str | None = None,
    memory_budget: int | float | str | None = None,
    verify: bool = True,
    measure_memory: bool = False,
    leaf_modules: tuple[str, ...] = (),
    dump_dir: str | Path | None = None,
) -> fx.GraphModule:
    """Return an optimized, verified GraphModule computing the same function as ``model``.

    ``passes``: None for the default pipeline, a list of names or (name, options) pairs, or a
    spec string like ``"inplace,checkpoint{budget=0.5}"``. ``memory_budget``: bytes, a string
    ("2GiB"), or a fraction of the unoptimized activation memory; it enables checkpointing.
    ``verify``: run the equivalence check and raise ``EquivalenceError`` on any mismatch.
    ``measure_memory``: measure peak memory before and after (real training steps).
    """
    config = Config(passes=passes, memory_budget=memory_budget, dump_dir=dump_dir)
    config.resolved()  # fail on a bad pass list before spending time on tracing
    args = as_args(example_inputs)
    gm = trace(model, args, leaf_modules=leaf_modules)
    report = Report(model=type(model).__name__, trace=gm.meta["fxopt_trace"])
    report.passes = run_passes(gm, config)
    gm.train(model.training)
    if verify:
        report.verification = run_verify(model, gm, args, strict=True)
    if measure_memory:
        report.memory_before = measure(model, args)
        report.memory_after = measure(gm, args)
    gm.fxopt_report = report
    return gm

