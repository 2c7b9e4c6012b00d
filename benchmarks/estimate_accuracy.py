"""How close ``fxopt.analysis.estimate_peak`` (fake tensors, no compute) is to the measured peak.

    python benchmarks/estimate_accuracy.py [--models a,b] [--batches 1,default]
                                           [--device cpu | cuda] [--include-large]

Prints, for every zoo model and batch size, the predicted and the measured peak of a training
step and of inference, the error in percent, and the seconds each took. On CPU the measurement
is exact live-storage tracking (``fxopt.measure``), the same accounting the estimate uses, so the
error shows only what fake kernels do differently from real ones. On CUDA the measurement is the
caching allocator's, which also counts rounding and kernel workspaces the estimate cannot see.
A model whose estimate or measurement raises is printed as ``error`` and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch

from fxopt import models_zoo
from fxopt.analysis import estimate_peak
from fxopt.bench.environment import device_name
from fxopt.measure.peaks import measure_inference, measure_train_step


def batches_for(entry: models_zoo.ZooEntry, spec: list[str]) -> list[int]:
    return sorted({entry.default_batch if b == "default" else int(b) for b in spec})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    parser.add_argument("--batches", default="1,default",
                        help="comma-separated batch sizes; 'default' is each model's own")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--include-large", action="store_true",
                        help="also models tagged 'large' (resnet152)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    device = torch.device(args.device)
    names = models_zoo.selected(args.models, include_large=args.include_large)

    print(f"estimate_peak vs measured peak; device: {device_name(device)}; torch {torch.__version__}; "
          f"{datetime.date.today().isoformat()}")
    print(f"{'model':<18} {'batch':>5} {'figure':<9} {'predicted':>13} {'measured':>13} "
          f"{'error':>8} {'est s':>6} {'meas s':>6}")
    worst = 0.0
    failed: list[str] = []
    for name in names:
        entry = models_zoo.get(name)
        for batch in batches_for(entry, args.batches.split(",")):
            try:
                worst = max(worst, compare(name, entry, batch, device))
            except Exception as error:  # noqa: BLE001 -- one model's failure is a row
                message = str(error).splitlines()[0] if str(error) else ""
                failed.append(f"{name}@{batch}")
                print(f"{name:<18} {batch:>5} error     {type(error).__name__}: {message}",
                      flush=True)
    print(f"worst |error|: {worst:.2f}%  (est s: half of one estimate_peak call, which "
          "predicts both figures)")
    if failed:
        print(f"failed: {', '.join(failed)}")


def compare(name: str, entry: models_zoo.ZooEntry, batch: int, device: torch.device) -> float:
    """Print the train and inference rows of one model at one batch; the larger |error| in %."""
    model = entry.build().to(device)
    inputs = tuple(t.to(device) for t in entry.example_inputs(batch))
    started = time.perf_counter()
    estimate = estimate_peak(model, inputs)
    estimate_seconds = time.perf_counter() - started
    worst = 0.0
    for figure, predicted, measure in (
            ("train", estimate.train_bytes, measure_train_step),
            ("inference", estimate.inference_bytes, measure_inference)):
        started = time.perf_counter()
        measured = measure(model, inputs).peak_bytes
        measure_seconds = time.perf_counter() - started
        error = 100 * (predicted - measured) / measured
        worst = max(worst, abs(error))
        print(f"{name:<18} {batch:>5} {figure:<9} {predicted:>13,} {measured:>13,} "
              f"{error:>+7.2f}% {estimate_seconds / 2:>6.2f} {measure_seconds:>6.2f}",
              flush=True)
    return worst


if __name__ == "__main__":
    main()
