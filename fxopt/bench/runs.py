"""Original vs fxopt vs peers: measured training peak, step time, and whether each is equal.

``bench(model, inputs, memory_budget=0.5)`` builds the variants -- the original model, fxopt's
optimized module, and each peer of ``fxopt.bench.peers`` at the same budget -- and, for each:

- checks it against the original with ``fxopt.verify`` (outputs, gradients, buffers): a peer that
  updates BatchNorm statistics twice or replays dropout differently is reported, not hidden;
- measures the peak of one training step with ``fxopt.measure.allocations`` (allocator level: the one
  method that also sees inside compiled graphs), above the baseline of parameters and inputs;
- times training steps (forward + backward, grads cleared first) *alternating* with the original,
  so ``time_ratio`` compares medians taken side by side in the same stretch of machine noise.

All of it runs on the user's Parameter objects under ``preserved_state``: grads, BatchNorm
statistics, training flags and the RNG are as before afterwards.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from fxopt.api import optimize
from fxopt.bench.peers import PEERS, build_peer
from fxopt.core.errors import FxoptError
from fxopt.core.state import preserved_state
from fxopt.core.step import as_args, training_step
from fxopt.core.tensors import module_device
from fxopt.measure.allocations import peak_allocated_during
from fxopt.measure.peaks import format_bytes
from fxopt.measure.timing import fresh_training_step, timed_against
from fxopt.planning.budget import (
    activation_bytes,
    budget_fraction,
    trainable_grad_bytes,
)
from fxopt.verify.equivalence import verify

Progress = Callable[[int, int, str], None]
DEFAULT_PEERS = ("checkpoint_sequential", "torch_compile_min_cut")


@dataclass(frozen=True)
class BenchRow:
    name: str                       # "original", "fxopt", or a peer's name
    train_peak_bytes: int | None    # above the baseline; None when the variant is unavailable
    step_seconds: float | None      # median training-step time
    memory_ratio: float | None      # train_peak_bytes / original's
    time_ratio: float | None        # step_seconds / original's, timed alternately
    equivalent: bool | None         # verified equal to the original (None: not checked)
    note: str                       # what it is, why unavailable, what differs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_peak_bytes(module: nn.Module, inputs: tuple) -> int:
    """Allocator-level peak of one training step above what was allocated before it."""
    device = module_device(module, inputs)
    with preserved_state(module):
        module.train()
        fresh_training_step(module, inputs)  # warm-up: compiles, and builds lazily-created state
        for p in module.parameters():
            p.grad = None
        return peak_allocated_during(lambda: training_step(module, inputs), device)


def _equivalence(model: nn.Module, variant: nn.Module, inputs: tuple) -> tuple[bool, str]:
    try:
        report = verify(model, variant, inputs)
    except FxoptError as error:
        return False, str(error).splitlines()[0]
    if report.ok:
        return True, ""
    worst = report.worst()[0]
    return False, f"differs: {worst.kind} {worst.name}"


def _peer_fraction(model: nn.Module, inputs: tuple, memory_budget: Any) -> float:
    """The budget as the fraction of activation memory the peers take."""
    if memory_budget is None:
        return 1.0
    from fxopt.analysis import estimate_peak
    from fxopt.capture.trace import trace

    estimate = estimate_peak(trace(model, inputs), inputs)
    activations = activation_bytes(estimate.train_bytes, estimate.baseline_bytes,
                                   trainable_grad_bytes(model))
    return budget_fraction(memory_budget, peak=estimate.train_bytes, activations=activations)


def bench(model: nn.Module, example_inputs: Any, *, passes: Any = None, memory_budget: Any = None,
          peers: tuple[str, ...] = DEFAULT_PEERS, repeats: int = 5,
          progress: Progress | None = None, capture: str = "auto") -> list[BenchRow]:
    """Measure original, fxopt and ``peers`` side by side; the first row is the original.
    ``capture`` is ``fxopt.optimize``'s capture frontend for the fxopt row."""
    inputs = as_args(example_inputs)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        from fxopt.core.errors import ConfigError
        raise ConfigError(f"unknown peer(s) {unknown}", hint=f"known peers: {', '.join(PEERS)}")
    total, done = 2 + len(peers), 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total, label)

    original_peak = step_peak_bytes(model, inputs)
    rows = [BenchRow("original", original_peak, None, 1.0, 1.0, True, "the model as given")]
    tick("original")
    fraction = _peer_fraction(model, inputs, memory_budget)
    builders: list[tuple[str, Callable[[], tuple[nn.Module | None, str]]]] = [
        ("fxopt", lambda: (optimize(model, inputs, passes=passes, memory_budget=memory_budget,
                                    capture=capture),
                           f"passes={passes or 'default'}, memory_budget={memory_budget}, "
                           f"capture={capture}")),
        *((name, lambda name=name: build_peer(name, model, inputs, fraction)) for name in peers),
    ]
    original_times = []
    for name, build in builders:
        try:
            variant, note = build()
        except FxoptError as error:
            variant, note = None, str(error).splitlines()[0]
        if variant is None:
            rows.append(BenchRow(name, None, None, None, None, None, note))
            tick(name)
            continue
        equal, why = (True, "") if name == "fxopt" else _equivalence(model, variant, inputs)
        peak = step_peak_bytes(variant, inputs)
        seconds, original_seconds = timed_against(model, variant, inputs, repeats)
        original_times.append(original_seconds)
        rows.append(BenchRow(name, peak, seconds, peak / original_peak if original_peak else None,
                             seconds / original_seconds, equal, "; ".join(filter(None, [note, why]))))
        tick(name)
    if original_times:
        rows[0] = BenchRow("original", original_peak, statistics.median(original_times), 1.0, 1.0,
                           True, "the model as given")
    return rows


def format_table(rows: list[BenchRow], device: str | None = None) -> str:
    """The rows as a text table, with the device and the measurement method named."""
    lines = [f"{'variant':<24}{'train peak':>12}{'x orig':>8}{'step s':>9}{'x orig':>8}  "
             f"{'equal':<6} note"]
    for row in rows:
        peak = format_bytes(row.train_peak_bytes) if row.train_peak_bytes is not None else "n/a"
        mem = f"{row.memory_ratio:.2f}" if row.memory_ratio is not None else "n/a"
        sec = f"{row.step_seconds:.3f}" if row.step_seconds is not None else "n/a"
        tim = f"{row.time_ratio:.2f}" if row.time_ratio is not None else "n/a"
        equal = {True: "yes", False: "NO", None: "-"}[row.equivalent]
        lines.append(f"{row.name:<24}{peak:>12}{mem:>8}{sec:>9}{tim:>8}  {equal:<6} {row.note}")
    where = device or ("cuda " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    lines.append(f"(device: {where}; train peak: allocator-level, above parameters and inputs; "
                 "step time: median, alternated with the original)")
    return "\n".join(lines)
