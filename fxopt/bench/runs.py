"""Original vs fxopt vs peers: measured training peak, step time, and whether each is equal.

``bench(model, inputs, memory_budget=0.5)`` builds the variants -- the original model, fxopt's
optimized module, and each peer of ``fxopt.bench.peers`` at the same budget -- and, for each:

- checks it against the original with ``fxopt.verify`` (outputs, gradients, buffers): a peer that
  updates BatchNorm statistics twice or replays dropout differently is reported, not hidden;
- measures the peak of one training step with ``fxopt.measure_train_step``, as ``fxopt optimize``
  and ``fxopt.measure`` do (one definition: exact storage tracking on CPU, the caching allocator
  on CUDA, and for compiled code, such as the ``torch.compile`` peer, the allocator after a
  warm-up call). ``train_peak_bytes`` is the whole step: the baseline of parameters, buffers and
  inputs plus the step's peak above it (``PEAK_DEFINITION``);
- shows a variant that cannot be built, checked, measured or timed as a row whose note says why:
  one failing peer never stops the others;
- times training steps of *all* variants in one run, the order rotating each round
  (``fxopt.bench.spread``), so every median sees the same stretch of machine noise and every
  ``time_ratio`` is the row's median over the original row's median, as printed.

A time ratio whose spread (slowest - fastest over median, of either row) exceeds its distance
from 1 is flagged ``time_within_noise``. All of it runs on the user's Parameter objects under
``preserved_state``: grads, BatchNorm statistics, training flags and the RNG are as before
afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from fxopt.api import optimize
from fxopt.bench.before_after import PEAK_DEFINITION, format_ms
from fxopt.bench.peers import PEERS, build_peer
from fxopt.bench.spread import StepTimes, TimeChange, alternated_step_times
from fxopt.core.errors import ConfigError, FxoptError
from fxopt.core.step import as_args
from fxopt.measure.peaks import format_bytes, measure_train_step
from fxopt.planning.budget import (
    activation_bytes,
    budget_fraction,
    trainable_grad_bytes,
)
from fxopt.verify.equivalence import verify

Progress = Callable[[int, int, str], None]
DEFAULT_PEERS = ("checkpoint_sequential", "torch_compile_min_cut")


def check_peers(peers: tuple[str, ...]) -> None:
    """A ``ConfigError`` naming the known peers when one of ``peers`` is not one of them."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ConfigError(f"unknown peer(s) {unknown}", hint=f"known peers: {', '.join(PEERS)}")


@dataclass(frozen=True)
class BenchRow:
    name: str                       # "original", "fxopt", or a peer's name
    train_peak_bytes: int | None    # whole step (PEAK_DEFINITION); None: variant unavailable
    step_seconds: float | None      # median training-step time
    memory_ratio: float | None      # train_peak_bytes / original's
    time_ratio: float | None        # step_seconds / original's step_seconds (same run)
    equivalent: bool | None         # verified equal to the original (None: not checked)
    note: str                       # what it is, why unavailable, what differs
    baseline_bytes: int | None = None       # parameters, buffers and inputs (in the peak)
    step_fastest_seconds: float | None = None
    step_slowest_seconds: float | None = None
    step_samples: int | None = None
    time_within_noise: bool | None = None   # the spread exceeds |time_ratio - 1|

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_peak_bytes(module: nn.Module, inputs: tuple) -> int:
    """Peak of one training step above what was allocated before it (parameters, buffers and
    inputs are not in it: ``train_peak_bytes`` adds them), as ``fxopt.measure`` measures it."""
    return measure_train_step(module, inputs).step_peak_bytes


def train_peak_bytes(module: nn.Module, inputs: tuple) -> tuple[int, int]:
    """``(whole-step peak, baseline)`` of one training step: ``fxopt.measure_train_step``'s
    ``peak_bytes`` and ``baseline_bytes``, the figures ``fxopt optimize`` and ``fxopt.measure``
    report (one definition: exact storage tracking on CPU, the caching allocator on CUDA, the
    allocator after a warm-up call for compiled code)."""
    figure = measure_train_step(module, inputs)
    return figure.peak_bytes, figure.baseline_bytes


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


@dataclass
class _Variant:
    name: str
    module: nn.Module | None
    note: str
    equivalent: bool | None = None
    peak: int | None = None
    baseline: int | None = None


def _row(variant: _Variant, original: _Variant, times: StepTimes | None,
         original_times: StepTimes | None) -> BenchRow:
    if variant.module is None or variant.peak is None:
        return BenchRow(variant.name, None, None, None, None, None, variant.note)
    memory_ratio = variant.peak / original.peak if original.peak else None
    if times is None or original_times is None:
        return BenchRow(variant.name, variant.peak, None, memory_ratio, None, variant.equivalent,
                        variant.note, variant.baseline)
    change = TimeChange(original_times, times)
    return BenchRow(variant.name, variant.peak, times.median, memory_ratio, change.ratio,
                    variant.equivalent, variant.note, variant.baseline, times.fastest,
                    times.slowest, len(times.samples),
                    None if variant is original else change.within_noise)


def bench(model: nn.Module, example_inputs: Any, *, passes: Any = None, memory_budget: Any = None,
          peers: tuple[str, ...] = DEFAULT_PEERS, repeats: int = 5,
          progress: Progress | None = None, capture: str = "auto",
          fused_optimizer: Any = None, dynamic: bool = True) -> list[BenchRow]:
    """Measure original, fxopt and ``peers`` side by side; the first row is the original.
    ``capture``, ``fused_optimizer`` and ``dynamic`` are ``fxopt.optimize``'s options for the
    fxopt row."""
    inputs = as_args(example_inputs)
    check_peers(peers)
    total, done = 3 + len(peers), 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total, label)

    original = _Variant("original", model, "the model as given", True)
    original.peak, original.baseline = train_peak_bytes(model, inputs)
    tick("original")
    fraction = _peer_fraction(model, inputs, memory_budget)
    builders: list[tuple[str, Callable[[], tuple[nn.Module | None, str]]]] = [
        ("fxopt", lambda: (optimize(model, inputs, passes=passes, memory_budget=memory_budget,
                                    capture=capture, fused_optimizer=fused_optimizer,
                                    dynamic=dynamic),
                           f"passes={passes or 'default'}, memory_budget={memory_budget}, "
                           f"capture={capture}{'' if dynamic else ', dynamic=False'}")),
        *((name, lambda name=name: build_peer(name, model, inputs, fraction)) for name in peers),
    ]
    variants = [original]
    for name, build in builders:
        variants.append(_built(name, build, model, inputs))
        tick(name)
    samples = _step_times(variants, inputs, repeats)
    tick("timing")
    return [_row(v, original, samples.get(v.name), samples["original"]) for v in variants]


def _step_times(variants: list[_Variant], inputs: tuple, repeats: int) -> dict[str, StepTimes]:
    """Step times of every variant that can be timed, alternated in one run; a variant whose
    step fails while timed is timed no more, and its note says why."""
    timed = [v for v in variants if v.module is not None]
    while True:
        try:
            times = alternated_step_times([v.module for v in timed], inputs, repeats)
            return dict(zip((v.name for v in timed), times))
        except Exception as error:  # which variant? time each alone once, to drop the failing
            failing = next((v for v in timed[1:] if _fails_a_step(v.module, inputs)), None)
            if failing is None:
                raise
            failing.note = "; ".join(filter(None, [failing.note, "timing failed: "
                                                   + _reason(error)]))
            timed.remove(failing)


def _fails_a_step(module: nn.Module, inputs: tuple) -> bool:
    try:
        alternated_step_times([module], inputs, 1)
    except Exception:
        return True
    return False


def _reason(error: BaseException) -> str:
    """One line: what went wrong, for a row's note."""
    first = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, FxoptError):
        return first
    return f"{type(error).__name__}: {first}"[:300]


def _built(name: str, build: Callable[[], tuple[nn.Module | None, str]], model: nn.Module,
           inputs: tuple) -> _Variant:
    """A variant built, checked against the original and its peak measured; ``module`` None
    when it cannot be built, checked or measured for this model (``note`` says why). fxopt's own
    row lets anything but an fxopt error through (a bug); a peer's failure of any kind is its
    row: one peer never stops the benchmark (checkpoint_sequential fails on a model whose
    in-place activations its recomputation trips over, as mobilenet_v2's ReLU6)."""
    errors = FxoptError if name == "fxopt" else Exception
    try:
        module, note = build()
    except errors as error:
        return _Variant(name, None, f"failed to build: {_reason(error)}")
    variant = _Variant(name, module, note)
    if module is None:
        return variant
    try:
        equal, why = (True, "") if name == "fxopt" else _equivalence(model, module, inputs)
        variant.equivalent, variant.note = equal, "; ".join(filter(None, [note, why]))
        variant.peak, variant.baseline = train_peak_bytes(module, inputs)
    except errors as error:
        variant.module, variant.equivalent = None, None
        variant.note = "; ".join(filter(None, [note, f"failed: {_reason(error)}"]))
    return variant


def _cell(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(rows: list[BenchRow], device: str | None = None) -> str:
    """The rows as a text table, with the device, the peak's definition and the method named.
    A time ratio within noise is marked ``?`` and explained under the table."""
    lines = [f"{'variant':<24}{'train peak':>12}{'x orig':>8}"
             f"{'step ms: fastest/median/slowest':>34}{'x orig':>8}  {'equal':<6} note"]
    for row in rows:
        peak = format_bytes(row.train_peak_bytes) if row.train_peak_bytes is not None else "n/a"
        times = "n/a" if row.step_seconds is None else "/".join(
            "n/a" if s is None else format_ms(s).removesuffix(" ms")
            for s in (row.step_fastest_seconds, row.step_seconds, row.step_slowest_seconds))
        ratio = _cell(row.time_ratio, ".2f") + ("?" if row.time_within_noise else "")
        equal = {True: "yes", False: "NO", None: "-"}[row.equivalent]
        lines.append(f"{row.name:<24}{peak:>12}{_cell(row.memory_ratio, '.2f'):>8}{times:>34}"
                     f"{ratio:>8}  {equal:<6} {row.note}")
    where = device or ("cuda " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    samples = next((r.step_samples for r in rows if r.step_samples), None)
    lines.append(f"(device: {where}; train peak: {PEAK_DEFINITION}, as fxopt.measure and "
                 "fxopt optimize measure it;")
    lines.append(f" step ms: {samples or 'n/a'} training steps of every variant, alternated in "
                 "one run; x orig: the row's figure over the original's)")
    if any(row.time_within_noise for row in rows):
        lines.append("? within noise: the spread of that row's or the original's step times "
                     "exceeds the change (fxopt.bench.spread);")
        lines.append("  rerun on a quiet machine, with more --repeats or with --threads N")
    return "\n".join(lines)
