"""The optimizer step fused into backward: training-step peak and step time, four ways.

    python benchmarks/fused_step.py [--models mnist_net,resnet18,...] [--optimizers adamw,...]
        [--steps 3] [--repeats 7] [--inner 3] [--threads 1] [--out FILE]

Models: zoo entries at their default batch (``models_zoo``), and the issue's models built from
constructors with random weights at 2x3x128x128: ``smp_unet_resnet18`` (smp Unet, resnet18
encoder, 2 classes), ``timm_lowformer_b0`` and ``timm_resnet33ts`` (10 classes). Optimizers:
``adamw`` (``AdamW(lr=1e-3, weight_decay=1e-2)``, on CPU torch's default for-loop
implementation), ``adamw_fused`` (the same with ``fused=True``: one kernel, no temporaries),
``sgd`` (``SGD(lr=1e-2, momentum=0.9)``).

Arms, per model and optimizer:

- ``plain``: the model and the ordinary optimizer (forward, backward, ``step()``,
  ``zero_grad()``);
- ``checkpointing``: ``fxopt.optimize(model, x, memory_budget="min")`` (verified by optimize)
  and the ordinary optimizer;
- ``fused``: the model and ``fxopt.fuse_optimizer`` (forward, backward with the updates,
  ``step()``, ``zero_grad()``);
- ``both``: the fused optimizer and ``fxopt.optimize(model, x, memory_budget="min")`` called
  with it fused, so the checkpoint pass plans with each gradient freed at its step and the
  step's temporaries (its own least-memory plan, which may differ from ``checkpointing``'s).

Columns:

- ``peak MiB``: the whole training-step peak at step ``--steps`` (step 3: Adam's moments exist
  in both arms since step 1, so both hold the same optimizer state), counted exactly on CPU by
  ``fxopt.verify.fused_training.verify_fused_training(measure_memory=True)``: every tensor
  storage allocated during forward, backward, the optimizer's update(s) and ``zero_grad``, on
  top of what is alive when the step starts (parameters, buffers, inputs, optimizer state, any
  gradient). ``x``: plain's peak over this arm's;
- ``step MiB``: that peak minus what was alive at the step's start (the part a step adds; fxopt's
  ``measure_train_step`` reports the same quantity for forward + backward alone, shown per model
  as ``today``); ``x``: plain's over this arm's, and ``today x``: today's over this arm's;
- ``time x``: step time over plain's. ``--repeats`` rounds; in each, every arm (and an identical
  copy of plain, the noise floor) runs ``--inner`` steps on its own copy of the model, in an
  order rotated each round; a round's ratio is the arm's median step over plain's. The median
  ratio and the min-max over rounds;
- ``verified``: ``fused``: ``verify_fused_training`` against plain over ``--steps`` steps
  (parameters, buffers, optimizer state after every step; ``bit`` when bit-identical);
  ``both``: its module with the fused optimizer against the same module with the ordinary one;
  ``checkpointing`` and ``both``'s module: by ``fxopt.optimize``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import os
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fxopt import models_zoo
from fxopt.api import optimize
from fxopt.bench.environment import TeeOutput, code_commit, device_name
from fxopt.core.errors import FxoptError
from fxopt.core.step import training_step
from fxopt.measure.peaks import measure_train_step
from fxopt.runtime.fuse import fuse_optimizer
from fxopt.runtime.fused_step import FusedOptimizer
from fxopt.verify.fused_training import verify_fused_training

MiB = 2**20
ISSUE_MODELS = ("smp_unet_resnet18", "timm_lowformer_b0", "timm_resnet33ts")
ZOO_MODELS = ("mnist_net", "resnet18", "mobilenet_v2", "transformer_lm", "unet")
OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2, "fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}
ARMS = ("plain", "checkpointing", "fused", "both")


def build(name: str) -> tuple[nn.Module, tuple]:
    """A fresh model (random weights from seed 0, train mode) and its positional inputs."""
    if name not in ISSUE_MODELS:
        return models_zoo.build(name)
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        if name == "smp_unet_resnet18":
            import segmentation_models_pytorch as smp
            model = smp.Unet(encoder_name="resnet18", encoder_weights=None, in_channels=3,
                             classes=2)
        else:
            import timm
            model = timm.create_model(name.removeprefix("timm_"), pretrained=False,
                                      num_classes=10)
    x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    return model.train(), (x,)


@dataclass
class Arm:
    name: str
    module: nn.Module | None = None      # the module measured (None: not applicable)
    peak: int | None = None
    step: int | None = None
    verified: str = "-"
    time: tuple[float, float, float] | None = None  # median, min, max ratio to plain
    note: str = ""


class Trainer:
    """One arm for timing: its own copy of the module and its own optimizer."""

    def __init__(self, module: nn.Module, optimizer: tuple[type, dict], fused: bool,
                 inputs: tuple):
        self.module, self.inputs = module.train(), inputs
        cls, kwargs = optimizer
        self.opt = (fuse_optimizer(module, cls, **kwargs) if fused
                    else cls(module.parameters(), **kwargs))

    def step(self) -> float:
        start = time.perf_counter()
        training_step(self.module, self.inputs)
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start


def time_arms(trainers: dict[str, Trainer], repeats: int, inner: int
              ) -> dict[str, tuple[float, float, float]]:
    for trainer in trainers.values():
        trainer.step()  # warm-up: allocations, the optimizer's state
    names = list(trainers)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        seconds = {name: [] for name in names}
        for _ in range(inner):
            for name in order:
                seconds[name].append(trainers[name].step())
        base = statistics.median(seconds["plain"])
        for name in names:
            ratios[name].append(statistics.median(seconds[name]) / base)
    return {name: (statistics.median(r), min(r), max(r)) for name, r in ratios.items()}


def checkpointed(model: nn.Module, inputs: tuple, fused: FusedOptimizer | None = None
                 ) -> tuple[nn.Module | None, str]:
    """fxopt's least-memory checkpointing of ``model`` (verified by optimize), planned for the
    fused optimizer step ``fused`` if given, and a note."""
    started = time.perf_counter()
    try:
        gm = optimize(model, inputs, memory_budget="min", fused_optimizer=fused)
    except FxoptError as error:
        return None, f"not applicable: {error.what.splitlines()[0][:90]}"
    checkpoint = next((r for r in gm.fxopt_report.passes if r.name == "checkpoint"), None)
    regions = len(checkpoint.stats.get("regions", ())) if checkpoint is not None else 0
    return gm, f"optimize {time.perf_counter() - started:.0f} s; {regions} regions"


def run(model: nn.Module, inputs: tuple, gm: nn.Module | None, gm_note: str,
        optimizer_name: str, args) -> dict[str, Arm]:
    optimizer = OPTIMIZERS[optimizer_name]
    cls, kwargs = optimizer
    arms = {arm: Arm(arm) for arm in ARMS}
    arms["plain"].module = arms["fused"].module = model
    planning = fuse_optimizer(model, cls, **kwargs)  # optimize plans for it; it steps nothing
    try:
        gm_both, both_note = checkpointed(model, inputs, planning)
    finally:
        planning.remove()
    for arm, module, note in (("checkpointing", gm, gm_note), ("both", gm_both, both_note)):
        arms[arm].note = note
        if module is not None:
            arms[arm].module = module
            arms[arm].verified = "optimize"
    # memory and verification: plain against fused; each checkpointed module with the ordinary
    # optimizer against itself with the fused one ("checkpointing" is the first's ordinary run,
    # "both" the second's fused run)
    pairs = [("plain", "fused", model), ("checkpointing", None, gm), (None, "both", gm_both)]
    for reference, candidate, module in pairs:
        if module is None:
            continue
        report = verify_fused_training(module, cls, inputs, steps=args.steps,
                                       measure_memory=True, **kwargs)
        (ref_peak, cand_peak), (ref_base, cand_base) = report.peaks[-1], report.baselines[-1]
        if reference is not None:
            arms[reference].peak, arms[reference].step = ref_peak, ref_peak - ref_base
        if candidate is None:
            continue
        arms[candidate].peak, arms[candidate].step = cand_peak, cand_peak - cand_base
        verdict = ("bit" if report.bit_identical else "yes") if report.ok else "NO"
        arms[candidate].verified = verdict
        if not report.ok:
            arms[candidate].note = str(report).splitlines()[1].strip()
    # time: every arm on its own copy, alternated
    trainers = {"plain": Trainer(copy.deepcopy(model), optimizer, False, inputs),
                "plain_copy": Trainer(copy.deepcopy(model), optimizer, False, inputs),
                "fused": Trainer(copy.deepcopy(model), optimizer, True, inputs)}
    if gm is not None:
        trainers["checkpointing"] = Trainer(copy.deepcopy(gm), optimizer, False, inputs)
    if gm_both is not None:
        trainers["both"] = Trainer(copy.deepcopy(gm_both), optimizer, True, inputs)
    times = time_arms(trainers, args.repeats, args.inner)
    for arm in arms.values():
        arm.time = times.get(arm.name)
    floor = times["plain_copy"]
    arms["plain"].note = f"identical copy timed against it: x{floor[0]:.3f} ({floor[1]:.2f}-" \
                         f"{floor[2]:.2f}, the noise floor)"
    for trainer in trainers.values():
        if hasattr(trainer.opt, "remove"):
            trainer.opt.remove()
    return arms


def table(name: str, optimizer_name: str, arms: dict[str, Arm], today: int,
          out: Callable[[str], None]) -> None:
    plain = arms["plain"]
    out(f"{'model':<20}{'optimizer':<13}{'arm':<15}{'peak MiB':>9}{'x':>6}{'step MiB':>9}"
        f"{'x':>6}{'today x':>8}{'time x':>8}{'spread':>12}  {'verified':<9}note")
    for arm in arms.values():
        if arm.peak is None:
            out(f"{name:<20}{optimizer_name:<13}{arm.name:<15}  {arm.note}")
            continue
        spread = f"{arm.time[1]:.2f}-{arm.time[2]:.2f}" if arm.time else "-"
        timing = f"{arm.time[0]:.3f}" if arm.time else "-"
        out(f"{name:<20}{optimizer_name:<13}{arm.name:<15}{arm.peak / MiB:>9.1f}"
            f"{plain.peak / arm.peak:>6.2f}{arm.step / MiB:>9.1f}{plain.step / arm.step:>6.2f}"
            f"{today / arm.step:>8.2f}{timing:>8}{spread:>12}  {arm.verified:<9}{arm.note}")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(ZOO_MODELS + ISSUE_MODELS))
    parser.add_argument("--optimizers", default="adamw,adamw_fused")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7, help="timing rounds")
    parser.add_argument("--inner", type=int, default=3, help="steps per arm per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = TeeOutput(args.out)
    out(f"# benchmarks/fused_step.py -- {datetime.date.today().isoformat()}; device: "
        f"{device_name('cpu')}; torch {torch.__version__}; timm {_version('timm')}; "
        f"segmentation-models-pytorch {_version('segmentation-models-pytorch')}; torch threads "
        f"{torch.get_num_threads()} of {os.cpu_count()} cores")
    out(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    malloc = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_"))
    commit = code_commit(None, ("fxopt", "passes", "benchmarks/fused_step.py"))
    out(f"# code: commit {commit or '(unknown)'}; allocator: glibc malloc"
        f"{', ' + malloc if malloc else ' with its default settings'}")
    out(f"# peak MiB: whole training-step peak at step {args.steps} (parameters, buffers, inputs, "
        "optimizer state, gradients, activations, the update's temporaries), exact live-storage "
        "tracking; step MiB: the peak minus what was alive when the step started; today: "
        "fxopt.measure_train_step's step peak (forward + backward, no update); x: plain (or "
        "today) over the arm; time x: median over rounds of the arm's median step over plain's, "
        "alternated, spread min-max; verified: over the same steps (bit: bit-identical)")
    failures = []
    for name in args.models.split(","):
        try:
            model, inputs = build(name)
        except ImportError as error:
            out(f"\n## {name}: skipped ({error})")
            continue
        today = measure_train_step(model, inputs)
        params = sum(p.numel() for p in model.parameters())
        shapes = ", ".join("x".join(map(str, t.shape)) for t in inputs if torch.is_tensor(t))
        out(f"\n## {name}: {type(model).__name__}, {params:,} parameters "
            f"({params * 4 / MiB:.1f} MiB), input {shapes}; today: step peak "
            f"{today.step_peak_bytes / MiB:.1f} MiB (gradients at the peak "
            f"{today.grads_at_peak_bytes / MiB:.1f} MiB)")
        gm, gm_note = checkpointed(model, inputs)
        for optimizer_name in args.optimizers.split(","):
            started = time.perf_counter()
            try:
                arms = run(model, inputs, gm, gm_note, optimizer_name, args)
            except Exception as error:  # a benchmark reports and goes on
                failures.append(f"{name} {optimizer_name}: {type(error).__name__}: {error}")
                out(f"{name} {optimizer_name}: FAILED {type(error).__name__}: "
                    f"{str(error).splitlines()[0][:120]}")
                continue
            table(name, optimizer_name, arms, today.step_peak_bytes, out)
            out(f"  ({name} {optimizer_name}: {time.perf_counter() - started:.0f} s)")
    if failures:
        out("\nfailures:")
        for line in failures:
            out(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
