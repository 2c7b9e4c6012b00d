"""What each pass does to every zoo model: measured peaks before and after, and step time.

    python benchmarks/pass_effects.py [--models a,b] [--repeats 5] [--budget 0.5] [--include-large]

For each model at its default example input, the passes run cumulatively in canonical order
(``inplace_activations``, then ``reorder``; with ``--budget``, ``checkpoint`` too), and after
each the table shows the measured training-step and inference peaks (``fxopt.measure``: exact
storage tracking on CPU), the saving against the traced original, the step time over the
original's (alternated, median of ``--repeats``) and whether the pass changed the graph. Every
rewritten model is verified against the original (outputs, gradients, buffers).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from fxopt import models_zoo
from fxopt.api import optimize
from fxopt.bench.environment import device_name
from fxopt.capture.trace import trace
from fxopt.core.errors import BudgetError
from fxopt.measure.peaks import format_bytes, measure
from fxopt.measure.timing import timed_against


def stages(budget: float | None) -> list[list]:
    base = [["inplace_activations"], ["inplace_activations", "reorder"]]
    if budget is None:
        return base
    return base + [["inplace_activations", ("checkpoint", {"budget": budget}), "reorder"]]


def label(passes: list) -> str:
    return "+".join(p if isinstance(p, str) else f"{p[0]}({p[1]['budget']})" for p in passes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--include-large", action="store_true")
    args = parser.parse_args()
    names = models_zoo.selected(args.models, include_large=args.include_large)
    print(f"passes on the zoo; device: {device_name(torch.device('cpu'))}; torch "
          f"{torch.__version__}; {datetime.date.today().isoformat()}; command: {' '.join(sys.argv)}")
    print(f"{'model':<18}{'passes':<52}{'train':>10}{'saved':>7}{'infer':>10}{'saved':>7}"
          f"{'time x':>8}  changed  equal")
    for name in names:
        model, inputs = models_zoo.build(name)
        original = trace(model, inputs)
        before = measure(original, inputs)
        print(f"{name:<18}{'(traced original)':<52}{format_bytes(before.train.peak_bytes):>10}"
              f"{'':>7}{format_bytes(before.inference.peak_bytes):>10}{'':>7}{1.0:>8.3f}", flush=True)
        for passes in stages(args.budget):
            try:
                gm = optimize(model, inputs, passes=passes)
            except BudgetError as error:
                print(f"{'':<18}{label(passes):<52}  {str(error).splitlines()[0]}", flush=True)
                continue
            after = measure(gm, inputs)
            seconds, base = timed_against(original, gm, inputs, args.repeats)
            changed = ",".join(r.name.split("_")[0] for r in gm.fxopt_report.passes if r.modified)
            train_saved = 1 - after.train.peak_bytes / before.train.peak_bytes
            infer_saved = 1 - after.inference.peak_bytes / before.inference.peak_bytes
            print(f"{'':<18}{label(passes):<52}{format_bytes(after.train.peak_bytes):>10}"
                  f"{train_saved:>7.1%}{format_bytes(after.inference.peak_bytes):>10}"
                  f"{infer_saved:>7.1%}{seconds / base:>8.3f}  {changed or '-':<8} "
                  f"{'yes' if gm.fxopt_report.verification.ok else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
