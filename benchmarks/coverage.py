"""Real-model coverage: every torchvision model through ``fxopt.optimize`` (verify + measure).

    python benchmarks/coverage.py [--models a,b] [--limit N] [--json OUT] [--resume]
                                  [--budget 0.6] [--size 128] [--timeout 900]
                                  [--max-param-mib 1500] [--fuse-optimizer adamw]
    python benchmarks/coverage.py --json OUT --markdown      # the results as a README table

The candidates are every torchvision classification model, every segmentation model, and the
backbone (``model.backbone``) of every detection model, all randomly initialised (no downloads).
Each runs in its own subprocess (so a crash, a timeout or memory use cannot spoil the next one)
through the default pipeline (plus checkpointing with ``--budget``) with ``verify=True`` and
``measure_memory=True``, at batch 2 and the smallest square input in ``SIZES`` on which the
model runs a train-mode forward (checked on fake tensors, so the search costs no compute).

Nothing is skipped silently: a model whose parameters exceed ``--max-param-mib`` is listed as
``too large`` with its size, a model that outlives ``--timeout`` as ``timeout``, and a model that
fails as the fxopt error it raised (or ``crash`` with the exception, which is an fxopt bug).

``--fuse-optimizer adamw`` fuses ``torch.optim.AdamW(lr=1e-3)`` into backward
(``fxopt.fuse_optimizer``) and hands it to ``optimize`` (``fused_optimizer=``), so the checkpoint
pass plans with each gradient freed at its step. The measured peaks run with the fused step
paused (fxopt's own runs never update parameters), so each row also gives the predicted training
peak with the fused step, before and after.

``--json OUT`` writes every result as it arrives; with ``--resume`` the models already in OUT are
not run again, so a long sweep can be done in chunks (``--limit``, ``--models``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

SIZES = (32, 64, 96, 128, 160, 224, 299)
BATCH = 2
MIB = 1024 * 1024
FUSABLE = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}  # --fuse-optimizer: torch.optim class


def candidates() -> list[str]:
    """Every model name the sweep knows, in a stable order."""
    from torchvision import models

    names = list(models.list_models(module=models))
    names += [f"segmentation.{n}" for n in models.list_models(module=models.segmentation)]
    names += [f"detection.{n}.backbone" for n in models.list_models(module=models.detection)]
    return names


def build(name: str) -> Any:
    """A randomly initialised model for a sweep name (deterministic: seeded here)."""
    import torch
    from torchvision import models

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # init-weights FutureWarnings of googlenet/inception
        if name.startswith("segmentation."):
            return models.get_model(name.split(".", 1)[1], weights=None, weights_backbone=None)
        if name.startswith("detection."):
            detector = models.get_model(name.split(".")[1], weights=None, weights_backbone=None)
            return detector.backbone
        return models.get_model(name, weights=None)


def runs_at(model: Any, size: int) -> bool:
    """Whether a train-mode forward works at ``BATCH x 3 x size x size`` (on fake tensors)."""
    import torch

    from fxopt.graph.fake_run import on_fake_tensors

    try:
        with on_fake_tensors(model, torch.empty(BATCH, 3, size, size)) as run:
            model(*run.inputs)
        return True
    except Exception:
        return False


def smallest_size(model: Any) -> int | None:
    was_training = model.training
    model.train()
    try:
        return next((s for s in SIZES if runs_at(model, s)), None)
    finally:
        model.train(was_training)


def run_one(name: str, budget: str | None, max_param_mib: float,
            size: int | None = None, fuse_optimizer: str = "") -> dict[str, Any]:
    """Optimize one model in this process; the result row as a dict."""
    import torch

    import fxopt

    torch.set_num_threads(1)
    started = time.perf_counter()
    row: dict[str, Any] = {"model": name}
    model = build(name)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    row["param_mib"] = round(param_bytes / MIB, 1)
    if param_bytes > max_param_mib * MIB:
        row.update(outcome="too large", detail=f"{param_bytes / MIB:.0f} MiB of parameters > "
                   f"--max-param-mib {max_param_mib:g} (verify keeps 3 copies: params, 2 grads)")
        return row
    size = size or smallest_size(model)
    if size is None:
        row.update(outcome="no input size", detail=f"no train-mode forward at sizes {SIZES}")
        return row
    row["input"] = f"{BATCH}x3x{size}x{size}"
    x = torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(0))
    fused = None
    if fuse_optimizer:
        row["fused"] = fuse_optimizer
        fused = fxopt.fuse_optimizer(model, getattr(torch.optim, FUSABLE[fuse_optimizer]), lr=1e-3)
    try:
        gm = fxopt.optimize(model, x, memory_budget=budget, verify=True, measure_memory=True,
                            fused_optimizer=fused)
    except fxopt.FxoptError as error:
        row.update(outcome=type(error).__name__, detail=str(error).splitlines()[0][:300],
                   where=(error.where or "")[:300])
    except Exception as error:  # an uncaught non-fxopt error is an fxopt bug: say so
        row.update(outcome="crash", detail=f"{type(error).__name__}: {error}"[:300])
    else:
        report = gm.fxopt_report
        row.update(
            outcome="equal",
            leaves=[f"{leaf.path} ({leaf.module_type})" for leaf in report.trace.leaves],
            passes={r.name: r.modified for r in report.passes},
            checked=report.verification.checked,
            train_before=report.memory_before.train.peak_bytes,
            train_after=report.memory_after.train.peak_bytes,
            infer_before=report.memory_before.inference.peak_bytes,
            infer_after=report.memory_after.inference.peak_bytes,
        )
        if fuse_optimizer:
            row.update(predicted_before=report.predicted_before.train_bytes,
                       predicted_after=report.predicted_after.train_bytes)
        row["trace"] = "leaves" if report.trace.leaves else "full"
        row["two_modes"] = report.trace.mode_dependent
        row["rounding"] = len(report.verification.rounding)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def run_in_subprocess(name: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", name, "--max-param-mib", str(args.max_param_mib)]
    if args.budget:
        command += ["--budget", args.budget]
    if args.size:
        command += ["--size", str(args.size)]
    if args.fuse_optimizer:
        command += ["--fuse-optimizer", args.fuse_optimizer]
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"model": name, "outcome": "timeout", "detail": f"over {args.timeout} s",
                "seconds": round(time.perf_counter() - started, 1)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": name, "outcome": "crash",
                "detail": f"worker exited with {done.returncode}: {tail}"[:300],
                "seconds": round(time.perf_counter() - started, 1)}
    return json.loads(lines[-1])


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / MIB:.1f}"


def _saved(before: int | None, after: int | None) -> str:
    return "" if not before or after is None else f"{(1 - after / before) * 100:.1f}%"


HEADER = (f"{'model':<44} {'input':<12} {'trace':<7} {'modes':<5} {'outcome':<16} "
          f"{'train MiB before':>17} {'after':>8} {'saved':>7} {'infer MiB before':>17} "
          f"{'after':>8} {'saved':>7} {'s':>6}")


def format_row(row: dict[str, Any]) -> str:
    modes = {True: "2", False: "1"}.get(row.get("two_modes"), "-")
    line = (f"{row['model']:<44} {row.get('input', '-'):<12} {row.get('trace', '-'):<7} "
            f"{modes:<5} {row['outcome']:<16} {_mib(row.get('train_before')):>17} "
            f"{_mib(row.get('train_after')):>8} "
            f"{_saved(row.get('train_before'), row.get('train_after')):>7} "
            f"{_mib(row.get('infer_before')):>17} {_mib(row.get('infer_after')):>8} "
            f"{_saved(row.get('infer_before'), row.get('infer_after')):>7} "
            f"{row.get('seconds', 0):>6.1f}")
    notes = [row["detail"]] if row.get("detail") else []
    if row.get("predicted_before"):
        notes.append(f"fused {row['fused']}: predicted train peak with the fused step "
                     f"{_mib(row['predicted_before'])} -> {_mib(row['predicted_after'])} MiB "
                     "(the measured columns ran with it paused)")
    notes += [f"leaf: {leaf}" for leaf in row.get("leaves", [])]
    if row.get("rounding"):
        notes.append(f"{row['rounding']} float32 difference(s) shown to be rounding (equal in "
                     "float64, no less accurate)")
    return line + "".join(f"\n    {note}" for note in notes)


def summary(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    equal = [r for r in rows if r["outcome"] == "equal"]
    lines = [
        f"{len(rows)} models: {counts.get('equal', 0)} optimized and verified equal "
        f"({sum(r['trace'] == 'full' for r in equal)} fully traced, "
        f"{sum(r['trace'] == 'leaves' for r in equal)} with leaf fallback; "
        f"{sum(bool(r.get('two_modes')) for r in equal)} with separate train/eval graphs)",
        "outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())),
    ]
    if equal:
        before = sum(r["train_before"] for r in equal)
        after = sum(r["train_after"] for r in equal)
        lines.append(f"train-step peak over the equal models: {before / MIB:.1f} MiB before, "
                     f"{after / MIB:.1f} MiB after ({_saved(before, after)} saved)")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table (for the README)."""
    lines = ["| model | input | trace | train/eval graphs | outcome | train peak MiB before → "
             "after | inference peak MiB before → after |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        modes = {True: "2", False: "1"}.get(row.get("two_modes"), "")
        outcome = row["outcome"] if row["outcome"] != "too large" else \
            f"too large ({row.get('param_mib', 0):.0f} MiB of parameters)"
        train = (f"{_mib(row['train_before'])} → {_mib(row['train_after'])}"
                 if row.get("train_before") else "")
        infer = (f"{_mib(row['infer_before'])} → {_mib(row['infer_after'])}"
                 if row.get("infer_before") else "")
        lines.append(f"| {row['model']} | {row.get('input', '')} | {row.get('trace', '')} | "
                     f"{modes} | {outcome} | {train} | {infer} |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--limit", type=int, default=0, help="run at most N models")
    parser.add_argument("--json", default="", help="write the results here as they arrive")
    parser.add_argument("--resume", action="store_true", help="skip models already in --json")
    parser.add_argument("--budget", default=None, help="memory_budget (enables checkpointing)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model")
    parser.add_argument("--fuse-optimizer", default="", choices=["", *FUSABLE],
                        help="fuse this optimizer's step into backward before optimizing")
    parser.add_argument("--size", type=int, default=0,
                        help="input height and width for every model (default: the smallest "
                        "that runs); a budget needs activations large enough to save on")
    parser.add_argument("--max-param-mib", type=float, default=1500.0)
    parser.add_argument("--list", action="store_true", help="print the candidate names and exit")
    parser.add_argument("--markdown", action="store_true",
                        help="print the results in --json as a markdown table and exit")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # worker mode
    args = parser.parse_args()

    if args.one:
        print(json.dumps(run_one(args.one, args.budget, args.max_param_mib, args.size or None,
                                 args.fuse_optimizer)))
        return
    if args.markdown:
        print(markdown(json.loads(Path(args.json).read_text())["rows"]))
        return
    names = args.models.split(",") if args.models else candidates()
    if args.list:
        print("\n".join(names))
        return
    rows: list[dict[str, Any]] = []
    out = Path(args.json) if args.json else None
    if out and args.resume and out.exists():
        rows = json.loads(out.read_text())["rows"]
    done = {r["model"] for r in rows}
    todo = [n for n in names if n not in done]
    if args.limit:
        todo = todo[:args.limit]

    import torch

    print(f"fxopt coverage sweep; {datetime.date.today().isoformat()}; device: CPU {cpu_name()}, "
          f"1 thread per model; torch {torch.__version__}; batch {BATCH}; "
          f"input {f'{args.size}x{args.size}' if args.size else 'smallest that runs'}; "
          f"budget {args.budget or 'none (default pipeline)'}"
          f"{'; fused ' + args.fuse_optimizer if args.fuse_optimizer else ''}; {len(todo)} to run, "
          f"{len(done)} already done", flush=True)
    print(HEADER, flush=True)
    for row in rows:
        print(format_row(row), flush=True)
    for name in todo:
        row = run_in_subprocess(name, args)
        rows.append(row)
        print(format_row(row), flush=True)
        if out:
            out.write_text(json.dumps({"budget": args.budget, "rows": rows}, indent=1))
    print(summary(rows), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
