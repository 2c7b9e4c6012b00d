"""CUDA validation in one command: the CUDA tests and the CUDA benchmarks, within ten minutes.

    python benchmarks/cuda_suite.py --out DIR [--budget-seconds 560]
        [--only tests,estimate,lm,main,sweep,pad,hf] [--commit SHA] [--dry-run]

Runs each part as a subprocess with a time limit of its own, in order of value, and writes
``DIR/<result>_cuda.txt`` per part (the names pair with ``benchmarks/results/*_cpu.txt``):

1. ``tests`` -> ``tests_cuda.txt``: pytest on every test that needs CUDA, by node id: those
   marked ``cuda`` and those only skipped unless ``torch.cuda.is_available()``;
2. ``estimate`` -> ``estimate_accuracy_cuda.txt``: ``estimate_peak`` vs the caching allocator's
   measured peak (``torch.cuda.max_memory_allocated``), every zoo model at batch 1 and 64;
3. ``lm`` -> ``lm_memory_cuda.txt``: a Llama-3.2-1B-width model in bfloat16 with AdamW, 4,096
   tokens a batch: the original, HF gradient checkpointing, HF checkpointing + Liger's fused
   linear cross-entropy (when ``liger_kernel`` imports) and fxopt's arms; the caching
   allocator's peaks and median step times, one run;
4. ``main`` -> ``main_job_cuda.txt``: the README's main job (``zoo:unet``, budget 0.6) on the
   GPU: peaks before and after, step times alternated;
5. ``sweep`` -> ``checkpoint_sweep_cuda.txt``: ResNet-50 at 32x3x224x224, fxopt at 0.5 and
   ``"min"`` vs ``checkpoint_sequential`` (torch.compile's min-cut is left out: its compile
   alone takes minutes);
6. ``pad`` -> ``pad_channels_cuda.txt``: channel padding in float16 and bfloat16, odd channel
   counts (30/60/100) and an LM head of vocab 50257;
7. ``hf`` -> ``hf_checkpointing_cuda.txt``: fxopt vs Hugging Face gradient checkpointing on a
   GPT-2 of vocab 50257 (needs transformers).

Each file starts with a header (date, device, torch, python, command, commit, time limit), then
the part's output as it is printed, so a part stopped at its limit keeps what it printed; a part
that runs out of time is recorded as ``timed out``. ``DIR/summary_cuda.txt`` lists every part's
status and seconds. The time limits are the parts' shares of ``--budget-seconds``, recomputed
before each step over the steps left, so time a quick part saves goes to the later ones and no
part can take another's share.

Without a CUDA device it exits 2 and runs nothing; ``--dry-run`` prints the plan (parts, commands,
time limits) and runs nothing. Exit status: 0 when every part passed, 1 otherwise.

Subprocesses run with this interpreter, from the repository root, with the root on PYTHONPATH
(so fxopt imports without being installed) and PYTHONUNBUFFERED=1.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET = 560.0
NO_CUDA_EXIT = 2
MIN_STEP_SECONDS = 10.0  # a step given less is skipped: starting python and torch takes seconds


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]   # argv[0] is "python": replaced by this interpreter when run
    share: float            # nominal seconds; the real limit is this share of the budget left


@dataclass(frozen=True)
class Part:
    key: str        # the name --only takes
    result: str     # DIR/<result>_cuda.txt
    title: str
    steps: tuple[Step, ...]


@dataclass
class Outcome:
    part: Part
    status: str = "not run"
    seconds: float = 0.0
    steps: list[str] = field(default_factory=list)


def _needs_cuda(decorators: list[ast.expr]) -> bool:
    text = " ".join(ast.unparse(d) for d in decorators)  # not get_source_segment: O(file) each
    return "mark.cuda" in text or "cuda.is_available" in text


def cuda_tests() -> list[str]:
    """pytest node ids of every test that needs CUDA: marked ``cuda``, or skipped unless
    ``torch.cuda.is_available()`` (``-m cuda`` alone would miss a test that is only skipped),
    found in tests/test_*.py by their decorators (a module's ``pytestmark`` too)."""
    ids = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text(encoding="utf-8")
        if "cuda" not in source:
            continue
        tree, name = ast.parse(source), str(path.relative_to(ROOT))
        whole = any(isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            and "mark.cuda" in ast.unparse(n) for n in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
                    "test") and (whole or _needs_cuda(node.decorator_list)):
                ids.append(f"{name}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                marked = whole or _needs_cuda(node.decorator_list)
                ids += [f"{name}::{node.name}::{m.name}" for m in node.body
                        if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
                        and m.name.startswith("test")
                        and (marked or _needs_cuda(m.decorator_list))]
    return ids


def plan() -> list[Part]:
    """Every part, in order of value, with its commands and nominal seconds (sized for an H100 or
    H200 inside ten minutes together: the 2026-11-27 H200 run gave each its share of 240 s and
    cut pad and both sweeps; torch.compile's ResNet-50 compile alone took over a minute)."""
    python = "python"
    return [
        Part("tests", "tests", "the CUDA tests (marked cuda, or skipped without a GPU)", (
            Step((python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                  *(cuda_tests() or ["-m", "cuda", "tests"])), 30),)),
        Part("estimate", "estimate_accuracy", "estimate_peak vs the CUDA caching allocator", (
            Step((python, "benchmarks/estimate_accuracy.py", "--device", "cuda",
                  "--batches", "1,64"), 35),)),
        # Issue 36's table: a Llama-3.2-1B-width model (8 layers, 749 M parameters) in bf16,
        # AdamW, 2 x 2048 tokens; the original, HF checkpointing (+ Liger), fxopt's arms,
        # optimized as a loop that trains at one shape would be (dynamic=False: two static
        # torch.export traces, not three symbolic ones, in the part's share of the budget).
        Part("lm", "lm_memory", "language model, bf16: fxopt vs HF checkpointing (+ Liger)", (
            Step((python, "benchmarks/lm_memory.py", "--device", "cuda", "--dtype", "bfloat16",
                  "--config", "llama-1b", "--layers", "8", "--seq", "2048", "--batch", "2",
                  "--steps", "5", "--static-shapes"), 210),)),
        # The README's main job on the GPU (issue 32: step time at budget 0.6).
        Part("main", "main_job", "the README's main job: zoo:unet 8x3x64x64 at budget 0.6", (
            Step((python, "-m", "fxopt", "optimize", "zoo:unet", "--input-shape", "8,3,64,64",
                  "--memory-budget", "0.6", "--device", "cuda", "--repeats", "20"), 30),)),
        # ResNet-50 at 32x3x224x224 (issue 32's targets); checkpoint_sequential as the peer,
        # torch.compile's min-cut left out (its compile takes minutes).
        Part("sweep", "checkpoint_sweep", "checkpointing: fxopt vs checkpoint_sequential", (
            Step((python, "benchmarks/checkpoint_sweep.py", "--device", "cuda",
                  "--models", "resnet50", "--budgets", "0.5,min", "--repeats", "3",
                  "--no-compile"), 90),)),
        Part("pad", "pad_channels", "channel padding, float16 and bfloat16, vocab 50257", (
            Step((python, "benchmarks/pad_channels.py", "--device", "cuda", "--repeats", "5"),
                 60),)),
        # GPT-2 small's width, sequence and vocabulary at half its depth: a 7.4 GiB predicted
        # training peak; fxopt's least-memory plan reaches about 4.2 GiB (fraction ~0.55).
        Part("hf", "hf_checkpointing",
             "Hugging Face GPT-2: fxopt vs gradient checkpointing", (
                 Step((python, "benchmarks/hf_checkpointing.py", "--device", "cuda",
                       "--models", "gpt2", "--layers", "6", "--hidden", "768", "--seq", "1024",
                       "--batch", "4", "--vocab", "50257", "--budgets", "0.7,min",
                       "--repeats", "3", "--no-peers"), 90),)),
    ]


def selected(parts: list[Part], only: str | None) -> list[Part]:
    if not only:
        return parts
    keys = [k.strip() for k in only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in {p.key for p in parts}]
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}; "
                         f"choose from {','.join(p.key for p in parts)}")
    return [p for p in parts if p.key in keys]


def limit_for(step: Step, later: list[Step], seconds_left: float) -> float:
    """``step``'s share of the seconds left, over itself and the steps after it."""
    total = step.share + sum(s.share for s in later)
    return max(0.0, seconds_left * step.share / total)


def command_line(step: Step) -> str:
    return shlex.join(step.argv)


def print_plan(parts: list[Part], budget: float, out: str | None) -> None:
    steps = [s for p in parts for s in p.steps]
    print(f"cuda_suite plan: {len(parts)} part(s), {len(steps)} step(s), budget {budget:.0f} s; "
          f"output: {out or '(--out DIR)'}; 'python' is {sys.executable}")
    left, index = budget, 0
    for part in parts:
        print(f"\n{part.key} -> {part.result}_cuda.txt: {part.title}")
        for step in part.steps:
            limit = limit_for(step, steps[index + 1:], left)
            print(f"  [limit {limit:.0f} s, more if earlier steps end early] {command_line(step)}")
            left -= limit
            index += 1
    print("\n(dry run: nothing was run)")


def git_commit(given: str | None) -> str:
    if given:
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git repository here; pass --commit)"
    return f"{sha}{' + uncommitted changes' if dirty.strip() else ''}"


def environment() -> dict[str, str]:
    """What the headers name: device, versions. Needs torch and a CUDA device."""
    import torch

    facts = {
        "device": f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, "
                  f"{torch.cuda.device_count()} device(s))",
        "torch": torch.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
    }
    try:
        import transformers
        facts["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001 -- absent or broken: the hf part will say so
        facts["transformers"] = "not importable"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], text=True, capture_output=True,
                             timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            facts["nvidia-smi"] = smi.stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


def header(title: str, facts: dict[str, str], commit: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# {title}", f"# date: {now}"]
    lines += [f"# {key}: {value}" for key, value in facts.items()]
    lines.append(f"# code: commit {commit}")
    lines.append(f"# suite: {shlex.join([sys.executable, *sys.argv])}")
    return "\n".join(lines) + "\n"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_step(step: Step, limit: float, log) -> tuple[str, float]:
    """Run one step with its output appended to ``log``; (status, seconds)."""
    argv = [sys.executable, *step.argv[1:]] if step.argv[0] == "python" else list(step.argv)
    log.write(f"\n## command: {command_line(step)}  (time limit {limit:.0f} s)\n\n")
    log.flush()
    offset = os.path.getsize(log.name)
    started = time.monotonic()
    # A session of its own: at the limit the step and every process it started (Inductor's
    # compile workers) are ended together, and nothing else.
    try:
        process = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    except OSError as error:
        status = f"failed (could not start: {error})"
        log.write(f"## result: {status}\n")
        return status, 0.0
    try:
        code = process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        _end(process)
        seconds = time.monotonic() - started
        status = f"timed out after {seconds:.0f} s (limit {limit:.0f} s)"
    else:
        seconds = time.monotonic() - started
        pytest = step.argv[1:3] == ("-m", "pytest")
        status = ("passed" if code == 0 else "failed (no test ran)" if pytest and code == 5
                  else f"failed (exit {code})")
        skipped = re.findall(r"(\d+) skipped", _read_from(log.name, offset)) if pytest else []
        if skipped:  # a CUDA test skipped on a GPU machine is worth a look
            status += f" ({skipped[-1]} skipped)"
    log.write(f"\n## result: {status}; {seconds:.1f} s\n")
    log.flush()
    return status, seconds


def _read_from(path: str, offset: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        handle.seek(offset)
        return handle.read()


def _end(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_parts(parts: list[Part], out: Path, budget: float, facts: dict[str, str],
              commit: str) -> list[Outcome]:
    steps = [s for p in parts for s in p.steps]
    deadline = time.monotonic() + budget
    outcomes, index = [], 0
    for part in parts:
        outcome = Outcome(part)
        outcomes.append(outcome)
        path = out / f"{part.result}_cuda.txt"
        print(f"[cuda_suite] {part.key}: {part.title} -> {path}", flush=True)
        path.write_text(header(f"{part.title} (cuda_suite part '{part.key}')", facts, commit),
                        encoding="utf-8")
        # Appending: the steps write through the same file, each at its end.
        with open(path, "a", encoding="utf-8") as log:
            for step in part.steps:
                limit = limit_for(step, steps[index + 1:], deadline - time.monotonic())
                index += 1
                if limit < MIN_STEP_SECONDS:
                    status, seconds = f"skipped (budget spent: {limit:.0f} s left for it)", 0.0
                    log.write(f"\n## command: {command_line(step)}\n## result: {status}\n")
                else:
                    status, seconds = run_step(step, limit, log)
                outcome.steps.append(f"{status}, {seconds:.0f} s: {command_line(step)}")
                outcome.seconds += seconds
        failed = [s for s in outcome.steps if not s.startswith("passed")]
        outcome.status = ("passed" if not failed else
                          "timed out" if all("timed out" in s for s in failed) else
                          "skipped" if all(s.startswith("skipped") for s in failed) else "failed")
        print(f"[cuda_suite] {part.key}: {outcome.status} in {outcome.seconds:.0f} s",
              flush=True)
    return outcomes


def write_summary(outcomes: list[Outcome], out: Path, budget: float, facts: dict[str, str],
                  commit: str, seconds: float) -> str:
    lines = [header("fxopt CUDA suite: summary", facts, commit).rstrip("\n"),
             f"# budget {budget:.0f} s; took {seconds:.0f} s", "",
             f"{'part':<10}{'status':<12}{'seconds':>8}  file"]
    for o in outcomes:
        lines.append(f"{o.part.key:<10}{o.status:<12}{o.seconds:>8.0f}  {o.part.result}_cuda.txt")
        lines += [f"    {s}" for s in o.steps]
    passed = sum(o.status == "passed" for o in outcomes)
    lines += ["", f"{passed} of {len(outcomes)} part(s) passed"]
    text = "\n".join(lines) + "\n"
    (out / "summary_cuda.txt").write_text(text, encoding="utf-8")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the *_cuda.txt files (created)")
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET,
                        help=f"seconds for all parts together (default {DEFAULT_BUDGET:.0f})")
    parser.add_argument("--only", help="comma-separated parts: "
                        + ",".join(p.key for p in plan()))
    parser.add_argument("--commit", help="the commit the headers name (default: git's HEAD)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the parts, commands and time limits; run nothing")
    return parser


def cuda_missing() -> str | None:
    """Why no CUDA device can be used, or None when one can."""
    try:
        import torch
    except Exception as error:  # noqa: BLE001 -- report any import failure plainly
        return f"torch does not import here ({type(error).__name__}: {error})"
    if not torch.cuda.is_available():
        return (f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'})")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parts = selected(plan(), args.only)
    except ValueError as error:
        parser.error(str(error))  # exits 2
    if args.dry_run:
        print_plan(parts, args.budget_seconds, args.out)
        return 0
    if not args.out:
        parser.error("--out DIR is required (or --dry-run)")
    why = cuda_missing()
    if why:
        print(f"cuda_suite.py: {why}. This suite measures on a GPU: run it on a machine with "
              "one (--dry-run prints the plan without running anything).", file=sys.stderr)
        return NO_CUDA_EXIT
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts, commit = environment(), git_commit(args.commit)
    started = time.monotonic()
    outcomes = run_parts(parts, out, args.budget_seconds, facts, commit)
    print(write_summary(outcomes, out, args.budget_seconds, facts, commit,
                        time.monotonic() - started), end="")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
