"""Checkpointing under a sweep of budgets: budget adherence, memory saved, time paid, vs peers.

    python benchmarks/checkpoint_sweep.py [--models resnet50,densenet121,unet,transformer_block]
        [--budgets auto | 1.0,0.8,...,min] [--repeats 3] [--peers / --no-peers]
        [--compile / --no-compile]
        [--predict-only] [--device cpu | cuda]

For each model, at a training-sized input, and each budget (a fraction of activation memory, or
``min``: the smallest peak the pass can reach; by default six fractions evenly spaced from 1.0 to
the least-memory plan's, then ``min``), it runs ``fxopt.optimize(memory_budget=...)``, every
budget from one capture (``fxopt.capture_model``), and reports:

- ``budget`` and ``measured``: the budget in bytes and the peak of one training step measured by
  ``fxopt.measure`` (exact storage tracking on CPU, the caching allocator on CUDA), both including
  parameters, buffers and inputs; ``over`` flags any overshoot (the target is zero);
- ``peak``: the whole training-step peak, allocator level (``fxopt.bench.runs.train_peak_bytes``:
  parameters, buffers, inputs, live gradients and activations; the method that also measures
  compiled peers): the figure an out-of-memory error depends on; ``peak x``: the unoptimized
  peak over this one;
- ``act``: activation memory at the peak, exact (``fxopt.measure_train_step``'s live-storage
  tracking on CPU): the live bytes at the peak minus parameters, buffers, inputs and the
  gradients alive at that moment -- not all gradients, since the peak usually comes early in
  backward with few alive; ``act x``: the unoptimized act over this one. "-" where it cannot be
  had: torch.compile's peers (their steps do not run op by op in eager) and CUDA (the allocator
  does not tell gradients from activations);
- ``time x``: median step time over the original's, timed alternately in the same run;
- ``equal``: verified against the original (outputs, gradients, BatchNorm buffers).

Peers at the same fractions: ``torch.compile`` with the min-cut partitioner under
``activation_memory_budget``, and ``checkpoint_sequential`` with sqrt(n) segments (one point: it
has no budget). A peer point is *dominated* when some fxopt point has no higher whole-step
peak and no more time. ``--predict-only`` prints only fxopt's plans and predicted peaks (no training steps).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass

import torch

from fxopt import models_zoo
from fxopt.analysis import estimate_peak
from fxopt.api import optimize
from fxopt.bench.environment import device_name
from fxopt.bench.peers import build_peer
from fxopt.bench.runs import train_peak_bytes
from fxopt.capture.reuse import capture_model
from fxopt.capture.trace import trace
from fxopt.core.errors import BudgetError
from fxopt.measure.peaks import CUDA_METHOD, MemoryFigure, measure_train_step
from fxopt.measure.timing import timed_against
from fxopt.planning.budget import budget_fraction
from fxopt.verify.equivalence import verify

# Inputs where activations, not weights, dominate a training step, yet a CPU step stays seconds.
INPUTS = {
    "resnet50": (8, 3, 128, 128),
    "densenet121": (8, 3, 128, 128),
    "unet": (8, 3, 128, 128),
    "transformer_block": (256, 32, 64),
}
# With --device cuda: inputs whose activations are gigabytes, as in a real GPU job (ResNet-50 at
# 224x224, batch 32: a 2.7 GiB predicted training peak), while a step stays milliseconds.
CUDA_INPUTS = {
    "resnet50": (32, 3, 224, 224),
    "densenet121": (32, 3, 224, 224),
    "unet": (16, 3, 256, 256),
    "transformer_block": (4096, 32, 64),
}
MiB = 2**20
TARGETS = {"resnet50": (2.5, 1.15), "densenet121": (2.5, 1.20)}  # (act reduction, time ratio)


@dataclass
class Point:
    method: str
    fraction: str
    budget_bytes: int | None
    measured_bytes: int | None
    peak_bytes: int | None      # whole training-step peak, allocator level
    act_bytes: int | None       # exact activations at the peak (eager CPU runs only)
    time_ratio: float
    equal: bool
    note: str


def smallest_budget(model, inputs, captured) -> int:
    try:
        optimize(model, inputs, memory_budget=1, verify=False, captured=captured)
    except BudgetError as error:
        return error.smallest_bytes
    raise AssertionError("a 1-byte budget was met")


def run_model(name: str, fractions: list[str], args, device: torch.device
              ) -> tuple[list[Point], int | None]:
    shape = (CUDA_INPUTS if device.type == "cuda" else INPUTS)[name]
    model = models_zoo.get(name).build().to(device)
    gen = torch.Generator().manual_seed(0)
    example = models_zoo.get(name).example_inputs(1)[0]
    inputs = (torch.randn(shape, generator=gen).to(device=device, dtype=example.dtype),)
    estimate = estimate_peak(trace(model, inputs), inputs)
    activations = estimate.activation_bytes  # what the budget fraction is a fraction of
    print(f"\n## {name}, input {'x'.join(map(str, shape))}: unoptimized peak "
          f"{estimate.train_bytes / MiB:.1f} MiB = baseline {estimate.baseline_bytes / MiB:.1f} "
          f"+ gradients at the peak {estimate.train_grad_bytes / MiB:.1f} + activations "
          f"{activations / MiB:.1f} (predicted)",
          flush=True)
    header = (f"{'method':<24}{'budget':>7}{'budget MiB':>11}{'measured':>10}{'over':>6}"
              f"{'peak MiB':>10}{'peak x':>7}{'act MiB':>9}{'act x':>7}{'time x':>8}  "
              f"{'equal':<6}note")
    original_peak = original_act = None
    if not args.predict_only:
        original_peak = train_peak_bytes(model, inputs)[0]
        original_act = exact_activations(measure_train_step(model, inputs))
        print(f"original: whole-step peak {original_peak / MiB:.1f} MiB (allocator), "
              f"activations at the peak "
              f"{'-' if original_act is None else f'{original_act / MiB:.1f}'} MiB (exact)")
    print(header, flush=True)
    points: list[Point] = []

    def ratio(original: int | None, value: int | None) -> str:
        return f"{original / value:.2f}" if original and value else "-"

    def report(point: Point) -> None:
        points.append(point)
        over = "-" if point.budget_bytes is None or point.measured_bytes is None else (
            "YES" if point.measured_bytes > point.budget_bytes else "no")
        budget = f"{point.budget_bytes / MiB:.1f}" if point.budget_bytes else "-"
        measured = f"{point.measured_bytes / MiB:.1f}" if point.measured_bytes else "-"
        peak = f"{point.peak_bytes / MiB:.1f}" if point.peak_bytes else "-"
        act = f"{point.act_bytes / MiB:.1f}" if point.act_bytes else "-"
        time_x = f"{point.time_ratio:.3f}" if point.time_ratio else "-"
        print(f"{point.method:<24}{point.fraction:>7}{budget:>11}{measured:>10}{over:>6}"
              f"{peak:>10}{ratio(original_peak, point.peak_bytes):>7}"
              f"{act:>9}{ratio(original_act, point.act_bytes):>7}{time_x:>8}  "
              f"{'yes' if point.equal else 'NO':<6}{point.note}", flush=True)

    captured = capture_model(model, inputs)  # one capture for every budget below
    smallest = smallest_budget(model, inputs, captured)
    if fractions == ["auto"]:
        lowest = budget_fraction(smallest, peak=estimate.train_bytes, activations=activations)
        fractions = [f"{1 - (1 - lowest) * k / 6:.2f}" for k in range(6)] + ["min"]
        print(f"(auto budgets: 1.0 down to the least-memory plan, fraction {lowest:.3f})")
    for fraction in fractions:
        budget = smallest if fraction == "min" else float(fraction)
        started = time.perf_counter()
        try:
            try:
                gm = optimize(model, inputs, memory_budget=budget, verify=not args.predict_only,
                              captured=captured)
            except BudgetError as error:
                # "min" is the least-memory plan: measured recompute times differ a little from
                # one profile to the next, and with them which of several near-equal plans the
                # planner settles on; take the smallest peak this optimize run says it reaches.
                if fraction != "min" or error.smallest_bytes is None:
                    raise
                budget = error.smallest_bytes
                gm = optimize(model, inputs, memory_budget=budget, verify=not args.predict_only,
                              captured=captured)
        except BudgetError as error:
            print(f"{'fxopt':<24}{fraction:>7}  infeasible: {str(error).splitlines()[0]}")
            continue
        seconds = time.perf_counter() - started
        stats = next((r.stats for r in gm.fxopt_report.passes if r.name == "checkpoint"), {})
        note = (f"{stats.get('regions_count', 0)} regions, predicted "
                f"{stats.get('predicted_after', 0) / MiB:.1f} MiB, optimize {seconds:.1f} s")
        if args.predict_only:
            report(Point("fxopt", fraction, stats.get("budget_bytes"), None, None, None, 0.0,
                         True, note))
            continue
        measured = measure_train_step(gm, inputs)
        slowdown, base = timed_against(model, gm, inputs, args.repeats)
        report(Point("fxopt", fraction, stats.get("budget_bytes"), measured.peak_bytes,
                     train_peak_bytes(gm, inputs)[0], exact_activations(measured),
                     slowdown / base, gm.fxopt_report.verification.ok, note))

    if args.predict_only or not args.peers:
        return points, original_act
    peer_runs = [("checkpoint_sequential", "-", 1.0)] + [
        ("torch_compile_min_cut", f, float(f)) for f in fractions
        if f != "min" and args.compile]
    for peer, label, value in peer_runs:
        variant, note = build_peer(peer, model, inputs, value)
        if variant is None:
            print(f"{peer:<24}{label:>7}  unavailable: {note}")
            continue
        equal = verify(model, variant, inputs)
        if not equal.ok:
            worst = equal.worst()[0]
            note += f"; differs: {worst.kind} {worst.name} (max abs {worst.max_abs_diff:.2g})"
        eager = peer == "checkpoint_sequential"
        slowdown, base = timed_against(model, variant, inputs, args.repeats)
        report(Point(peer, label, None, None, train_peak_bytes(variant, inputs)[0],
                     exact_activations(measure_train_step(variant, inputs)) if eager else None,
                     slowdown / base,
                     equal.ok, note))
    return points, original_act


def exact_activations(figure: MemoryFigure) -> int | None:
    """Activations at the training peak, exact (live-storage tracking); None on CUDA, whose
    allocator does not tell them from gradients."""
    return None if figure.method == CUDA_METHOD else figure.activations_at_peak_bytes


def summarise(name: str, points: list[Point], original_act: float | None) -> None:
    ours = [p for p in points if p.method == "fxopt" and p.peak_bytes]
    if not ours:
        return
    for peer in (p for p in points if p.method != "fxopt"):
        better = [o for o in ours
                  if o.peak_bytes <= peer.peak_bytes and o.time_ratio <= peer.time_ratio]
        verdict = (f"dominated by fxopt@{better[0].fraction}" if better
                   else "NOT dominated by any fxopt point")
        print(f"  {peer.method}@{peer.fraction}: {verdict}")
    if name in TARGETS and original_act:
        reduction, time_limit = TARGETS[name]
        within = [p for p in ours if p.time_ratio <= time_limit and p.act_bytes]
        best = max((original_act / p.act_bytes for p in within), default=0.0)
        print(f"  target: >= {reduction}x less activation memory at <= "
              f"{(time_limit - 1) * 100:.0f}% extra time; best reached: {best:.2f}x "
              f"-> {'met' if best >= reduction else 'NOT met'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(INPUTS))
    parser.add_argument("--budgets", default="auto",
                        help="comma-separated fractions and 'min', or 'auto': six fractions "
                             "evenly from 1.0 to the least-memory plan's, and 'min'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="with the peers, torch.compile's min-cut partitioner (Inductor's "
                             "compile takes minutes on ResNet-50)")
    parser.add_argument("--predict-only", action="store_true")
    parser.add_argument("--device", default="cpu",
                        help="cpu (inputs: INPUTS) or cuda (larger inputs: CUDA_INPUTS)")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    device = torch.device(args.device)
    print(f"checkpoint sweep; device: {device_name(device)}; torch {torch.__version__}; "
          f"{datetime.date.today().isoformat()}; command: {' '.join(sys.argv)}")
    for name in args.models.split(","):
        started = time.perf_counter()
        points, original_act = run_model(name, args.budgets.split(","), args, device)
        summarise(name, points, original_act)
        print(f"  ({name}: {time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
