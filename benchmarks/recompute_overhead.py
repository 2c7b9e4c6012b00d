"""What a checkpointed region costs beyond the arithmetic it recomputes, at inputs where a step is
dispatch and bookkeeping.

    python benchmarks/recompute_overhead.py [--models grouped_cnn,unet,...] [--budgets 1.0,0.6,0.5,min]
        [--threads 1] [--min-seconds 3] [--profile MODEL:BUDGET] [--device cpu|cuda] [--out FILE]

For each model at the zoo's own (tiny) example input, the arms are the original model and
``fxopt.optimize(model, x, memory_budget=b)`` for each budget ``b`` (``1.0``: the same pipeline
with a plan that recomputes nothing); with ``--torch-arms``, also ``b/torch``: the same module,
the same plan, its regions run through ``torch.utils.checkpoint`` as fxopt ran them before its
regions had recompute graphs (selective checkpointing's dispatch mode, an RNG stash per region,
buffers copied for every recomputation), so the two runtimes are compared on one plan in one
run. Each row gives:

- ``regions``: the plan's regions, full (``F``), selective (``S``) and light (``L``);
- ``step ms``: the arm's median step; ``+ms``: the median, over rounds, of its step minus the
  original's; ``pred ms``: what the plan predicted its recomputation costs (the planner's
  per-node forward times, measured on the device, plus its per-region cost): the arithmetic;
- ``rec ms``: the median, over separate steps after the alternated ones, of the time one training
  step spends recomputing its regions (inside ``RegionFrame.recompute``, the device synchronised
  around each; ``-`` for the ``/torch`` arms, whose regions torch recomputes): the arithmetic of
  the plan as it runs, so ``+ms`` minus it is what the regions cost beyond their recomputation;
- ``time x``: the median, over rounds, of the arm's step time over the original's in the same round
  (training steps alternated in rotating order, ``fxopt.measure.timing.alternated_samples``), with
  the spread of those per-round ratios (10th to 90th percentile);
- the Python-level work of one training step (forward and backward) of the arm, counted with
  ``sys.setprofile``: every Python function call (``py calls``), the calls of a
  ``__torch_dispatch__`` (a dispatch mode's callback per ATen op: selective checkpointing's
  policy), RNG state reads and writes (``get_rng_state`` / ``set_rng_state``, any device), and
  buffers copied to shield them from recomputation (``Tensor.clone`` calls made by a shield).

A budget the pass cannot meet (``BudgetError``) prints the least fraction it can reach instead of a
row. ``--profile MODEL:BUDGET`` prints cProfile's top functions (by own time) over 20 steps of
that arm.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import re
import statistics
import sys
import time
import warnings
from collections import Counter
from typing import Any

import torch

import fxopt.models_zoo as models_zoo
from fxopt.api import optimize
from fxopt.bench.environment import TeeOutput, device_name, header
from fxopt.core.errors import BudgetError
from fxopt.core.state import preserved_state
from fxopt.measure.timing import alternated_samples, fresh_training_step
from fxopt.runtime.region_frame import RegionFrame
from fxopt.runtime.regions import CheckpointedRegion

MODELS = "grouped_cnn,odd_channel_cnn,resnet18,unet,mobilenet_v2,densenet121,resnet50"
RNG_CALLS = {"get_rng_state", "set_rng_state"}  # torch's, torch.cuda's: the API-level calls
SHIELDS = {"buffers_shielded", "_copied_buffers"}  # the region runtime's buffer-copying shields


class StepCounter:
    """Counts Python-level events of the code run under it (``sys.setprofile``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._shielding = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_name
            self.counts["py calls"] += 1
            if name == "__torch_dispatch__":
                self.counts["dispatch"] += 1
            elif name in RNG_CALLS:
                self.counts["rng"] += 1
            elif name in SHIELDS:
                self.counts["shields"] += 1
        elif event == "c_call":
            name = getattr(arg, "__name__", "")
            if name in RNG_CALLS:
                self.counts["rng"] += 1
            elif name == "clone" and _inside(sys._getframe(1), SHIELDS):
                self.counts["buffer copies"] += 1


def _inside(frame: Any, names: set[str], depth: int = 6) -> bool:
    while frame is not None and depth:
        if frame.f_code.co_name in names:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def counted_step(module: torch.nn.Module, inputs: tuple) -> Counter[str]:
    """The events of one training step (``StepCounter``), module and RNG left as they were."""
    counter = StepCounter()
    with preserved_state(module):
        module.train()
        fresh_training_step(module, inputs)  # warm
        sys.setprofile(counter)
        try:
            fresh_training_step(module, inputs)
        finally:
            sys.setprofile(None)
    return counter.counts


def recompute_ms(module: torch.nn.Module, inputs: tuple, device: torch.device,
                 steps: int = 7) -> float:
    """Median milliseconds one training step of ``module`` spends in ``RegionFrame.recompute``
    (over ``steps`` steps after a warm one), the device synchronised around each recompute."""
    spent: list[float] = []
    plain = RegionFrame.recompute

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(frame: RegionFrame) -> None:
        sync()
        start = time.perf_counter()
        plain(frame)
        sync()
        spent[-1] += time.perf_counter() - start

    RegionFrame.recompute = timed
    try:
        with preserved_state(module):
            module.train()
            for _ in range(steps + 1):
                spent.append(0.0)
                fresh_training_step(module, inputs)
    finally:
        RegionFrame.recompute = plain
    return statistics.median(spent[1:]) * 1e3


def regions_of(gm: torch.nn.Module) -> tuple[str, float]:
    """("<n> (<full>F <selective>S[ <light>L])", the plan's predicted recompute milliseconds)."""
    stats = next((p.stats for p in getattr(gm, "fxopt_report").passes
                  if p.name == "checkpoint"), {})
    modes = [r.mode for r in stats.get("regions", [])]
    if not modes:
        return "0", 0.0
    extra = sum(r.predicted_extra_ms for r in stats["regions"])
    light = f" {modes.count('light')}L" if "light" in modes else ""
    return (f"{len(modes)} ({modes.count('full')}F {modes.count('selective')}S{light})",
            extra)


def through_torch_checkpoint(gm: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``gm`` whose regions run through ``torch.utils.checkpoint``, the way a
    region without a recompute graph runs."""
    clone = copy.deepcopy(gm)
    for module in clone.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, CheckpointedRegion):
                value.forward = value.recompute = None
    return clone


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--budgets", default="1.0,0.6,0.5,min")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=3.0)
    parser.add_argument("--profile", default="")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--torch-arms", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    out = TeeOutput(args.out)
    device = torch.device(args.device)
    for line in header(__file__, device_name(device)):
        out(line)
    out("# time x: median over rounds of (arm step / original step, same round), spread 10-90%; "
        "counts: one training step (forward + backward) under sys.setprofile")
    out(f"{'model':<16}{'input':<14}{'arm':<11}{'regions':<12}{'step ms':>9}{'+ms':>8}"
        f"{'pred ms':>8}{'rec ms':>8}{'time x':>8}"
        f"{'spread':>13}{'py calls':>10}{'dispatch':>10}{'rng':>6}{'shields':>9}"
        f"{'buf copies':>11}")
    for name in models_zoo.selected(args.models):
        model, inputs = models_zoo.build(name)
        model.to(device)
        inputs = tuple(t.to(device) for t in inputs)
        shape = "x".join(map(str, inputs[0].shape))
        arms: dict[str, torch.nn.Module] = {"orig": model}
        regions: dict[str, tuple[str, float]] = {"orig": ("-", 0.0)}
        for budget in args.budgets.split(","):
            value: Any = budget if budget == "min" else float(budget)
            try:
                gm = optimize(model, inputs, memory_budget=value, verify=False,
                              predict_memory=False)
            except BudgetError as error:
                reach = re.search(r"a fraction ([0-9.]+)", str(error))
                out(f"{name:<16}{shape:<14}{budget:<8}unreachable: the least-memory plan "
                    f"reaches {reach.group(1) if reach else '?'} of the activations")
                continue
            arms[budget], regions[budget] = gm, regions_of(gm)
            if args.torch_arms and regions[budget][0] != "0":
                arms[f"{budget}/torch"], regions[f"{budget}/torch"] = (
                    through_torch_checkpoint(gm), regions[budget])
        started = time.perf_counter()
        samples = alternated_samples(list(arms.values()), inputs, 20,
                                     min_seconds=args.min_seconds, max_repeats=2000)
        for label, module, times in zip(arms, arms.values(), samples):
            ratios = [t / o for t, o in zip(times, samples[0])]
            counts = counted_step(module, inputs)
            recomputed = ("-" if label.endswith("/torch") else
                          f"{recompute_ms(module, inputs, device):.2f}")
            excess = statistics.median([t - o for t, o in zip(times, samples[0])]) * 1e3
            out(f"{name:<16}{shape:<14}{label:<11}{regions[label][0]:<12}"
                f"{statistics.median(times) * 1e3:>9.2f}{excess:>8.2f}{regions[label][1]:>8.2f}"
                f"{recomputed:>8}{statistics.median(ratios):>8.3f}"
                f"{f'{_quantile(ratios, 0.1):.2f}-{_quantile(ratios, 0.9):.2f}':>13}"
                f"{counts['py calls']:>10}{counts['dispatch']:>10}{counts['rng']:>6}"
                f"{counts['shields']:>9}{counts['buffer copies']:>11}")
        out(f"  ({name}: {len(samples[0])} rounds, {time.perf_counter() - started:.0f} s)")
        for spec in filter(None, args.profile.split(",")):
            model_name, _, budget = spec.partition(":")
            if model_name == name and budget in arms:
                _profile(arms[budget], inputs, out)
    return 0


def _profile(module: torch.nn.Module, inputs: tuple, out: TeeOutput) -> None:
    profiler = cProfile.Profile()
    with preserved_state(module):
        module.train()
        fresh_training_step(module, inputs)
        profiler.enable()
        for _ in range(20):
            fresh_training_step(module, inputs)
        profiler.disable()
    stream = __import__("io").StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(15)
    for line in stream.getvalue().splitlines():
        out("    " + line)


if __name__ == "__main__":
    sys.exit(main())
