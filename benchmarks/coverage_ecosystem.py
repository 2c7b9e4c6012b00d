"""Ecosystem coverage: every ``models_zoo.ecosystem`` model through ``fxopt.optimize``.

With them, the models of ``models_zoo/leaves.py`` whose data-dependent submodule fxopt keeps as
an opaque leaf (``LEAF_MODELS``: a value-branching CNN, an index-dispatch MoE transformer given
``leaf_modules=``, OLMoE with transformers' eager expert loop); their rows also say whether the
predicted training peak equals the measured one.

    python benchmarks/coverage_ecosystem.py [--models a,b] [--library transformers] [--limit N]
                                            [--out FILE] [--json OUT] [--resume]
                                            [--budget min] [--timeout 300] [--jobs 2]
    python benchmarks/coverage_ecosystem.py --list [--library timm]

The models are small, randomly initialised models from transformers, diffusers,
segmentation-models-pytorch, monai and timm (``models_zoo/ecosystem.py``; nothing downloads),
called as their users call them (Hugging Face models with keyword inputs). Each runs in its own
subprocess, on one CPU thread (``--jobs N`` runs N at once), which records:

- the frontend that captured it (``gm.fxopt_report.trace.frontend``; ``fx+N leaves`` when
  symbolic tracing kept N submodules opaque, ``-`` when nothing captured it);
- the outcome of the default pipeline, ``fxopt.optimize(model, args, example_kwargs=kwargs)``
  with ``verify=True``: ``equal``, or the fxopt error it raised;
- the outcome with ``memory_budget`` (``--budget``: default "min", the least memory the
  checkpoint pass reaches; or a fraction of the activation memory such as 0.5, bytes, or a size
  such as 300MB): ``equal``, ``budget-unreachable`` for a ``BudgetError`` (a legitimate answer
  to a fraction or a size), or the error;
- activation memory and peak memory of one training step, measured with
  ``fxopt.measure_train_step`` (``activations_at_peak_bytes``, ``peak_bytes``) on the model
  and on each optimized module, and the seconds each ``optimize`` took.

An exception that is not an ``fxopt.FxoptError`` is a bug in fxopt: it is listed as ``crash``
with the last line of its traceback, and counted in the summary as a raw exception. A model
whose library (or a package it needs) is not installed is skipped with a note. ``--out FILE``
writes the table with a header naming the date, the device, the versions of torch and of each
library, and the command line; ``--json OUT`` keeps every result (tracebacks included) as it
arrives, and ``--resume`` does not run again the models already in OUT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any


MIB = 1024 * 1024
TRACEBACK_LINES = 15
# Outcomes a model is built to show: the error class and a phrase its message must contain.
EXPECTED = {"hf_gpt2_lm_use_cache": ("TraceError", "use_cache=False")}
# Models with a data-dependent submodule fxopt keeps as an opaque leaf, measured on a real run
# (models_zoo/leaves.py, issue 25): name -> (library, factory, leaf_modules). The factory gives
# (model, positional inputs) or (model, keyword inputs).
LEAF_MODELS = {
    "leaves_branchy_cnn": ("torch", "branchy_cnn", ()),
    "leaves_moe_transformer": ("torch", "moe_transformer", ("blocks.0.moe", "blocks.1.moe")),
    "hf_olmoe_eager_experts": ("transformers", "olmoe_eager_experts", ()),
}
DISTRIBUTIONS = {"transformers": "transformers", "diffusers": "diffusers",
                 "smp": "segmentation-models-pytorch", "monai": "monai", "timm": "timm"}


def _tail(error: BaseException) -> list[str]:
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    return "".join(lines).rstrip().splitlines()[-TRACEBACK_LINES:]


def _failure(error: BaseException) -> dict[str, Any]:
    """The outcome fields for an exception: fxopt's own errors by class, others as a crash."""
    import fxopt

    first = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, fxopt.FxoptError):
        return {"outcome": type(error).__name__, "detail": first[:300],
                "message": str(error)[:2000], "where": (error.where or "")[:300],
                "traceback": _tail(error)}
    return {"outcome": "crash", "detail": f"{type(error).__name__}: {first}"[:300],
            "raw": True, "traceback": _tail(error)}


def _frontend(trace: Any) -> str:
    leaves = len(trace.leaves)
    return f"{trace.frontend}+{leaves} leaves" if leaves else trace.frontend


def _measured(module: Any, args: tuple, kwargs: dict, prefix: str, row: dict[str, Any]) -> None:
    import fxopt

    try:
        figure = fxopt.measure_train_step(module, args, example_kwargs=kwargs)
    except Exception as error:  # noqa: BLE001 -- reported, not hidden
        row.setdefault("measure_errors", []).append({"what": prefix, **_failure(error)})
        return
    row[f"{prefix}_act"] = figure.activations_at_peak_bytes
    row[f"{prefix}_peak"] = figure.peak_bytes


def _optimize(model: Any, args: tuple, kwargs: dict, budget: str | None,
              row: dict[str, Any], key: str, leaf_modules: tuple[str, ...] = ()) -> Any:
    """Run optimize; store ``{key: {...outcome}}`` in row; the module, or None on failure."""
    import fxopt

    started = time.perf_counter()
    result: dict[str, Any]
    gm = None
    try:
        memory_budget = None if budget is None else _budget_value(budget)
        gm = fxopt.optimize(model, args, example_kwargs=kwargs, memory_budget=memory_budget,
                            leaf_modules=leaf_modules)
    except fxopt.BudgetError as error:
        result = {"outcome": "budget-unreachable", "detail": str(error).splitlines()[0][:300]}
    except Exception as error:  # noqa: BLE001 -- every failure is a result here
        result = _failure(error)
    else:
        report = gm.fxopt_report
        result = {"outcome": "equal", "frontend": _frontend(report.trace),
                  "not_used": dict(report.trace.not_used),
                  "leaves": [f"{leaf.path} ({leaf.module_type})" for leaf in report.trace.leaves],
                  "passes": {r.name: r.modified for r in report.passes},
                  "rounding": len(report.verification.rounding),
                  "predicted_peak": getattr(report.predicted_after, "train_bytes", None)}
    result["seconds"] = round(time.perf_counter() - started, 2)
    row[key] = result
    return gm


def _budget_value(budget: str) -> int | float | str:
    """A --budget string as optimize takes it: a fraction or whole bytes as numbers, "min" and
    sizes with a unit as they are."""
    try:
        value = float(budget)
    except ValueError:
        return budget
    return value if 0 < value <= 1 else int(value)


def _capture_frontend(model: Any, args: tuple, kwargs: dict,
                      leaf_modules: tuple[str, ...] = ()) -> str:
    """The frontend that captures ``model`` (for a model whose optimize failed after capture)."""
    from fxopt.capture.chain import capture

    try:
        return _frontend(capture(model, args, example_kwargs=kwargs,
                                 leaf_modules=leaf_modules).meta["fxopt_trace"])
    except Exception:  # noqa: BLE001 -- nothing captures it
        return "-"


def run_one(name: str, budget: str) -> dict[str, Any]:
    """Optimize one model in this process; the result row as a dict."""
    import torch

    from fxopt.models_zoo import ecosystem

    torch.set_num_threads(1)
    _quiet_libraries()
    started = time.perf_counter()
    row: dict[str, Any] = {"model": name, "library": _library_of(name) or "?"}
    leaf_modules: tuple[str, ...] = LEAF_MODELS[name][2] if name in LEAF_MODELS else ()
    try:
        model, args, kwargs = _built(name)
    except Exception as error:  # noqa: BLE001 -- the library's or the catalogue's failure
        row.update(outcome="not built", detail=f"{type(error).__name__}: {error}"[:300],
                   traceback=_tail(error), seconds=round(time.perf_counter() - started, 1))
        return row
    if leaf_modules:
        row["leaf_modules"] = list(leaf_modules)
    row["params"] = sum(p.numel() for p in model.parameters())
    _measured(model, args, kwargs, "before", row)
    gm = _optimize(model, args, kwargs, None, row, "default", leaf_modules)
    if gm is not None:
        _measured(gm, args, kwargs, "default", row)
        row["frontend"] = row["default"]["frontend"]
    elif row["default"]["outcome"] in ("TraceError", "InputError"):
        row["frontend"] = "-"
    else:
        row["frontend"] = _capture_frontend(model, args, kwargs, leaf_modules)
    del gm
    gm = _optimize(model, args, kwargs, budget, row, "budget", leaf_modules)
    if gm is not None:
        _measured(gm, args, kwargs, "budget", row)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def _library_of(name: str) -> str | None:
    from fxopt.models_zoo import ecosystem

    return LEAF_MODELS[name][0] if name in LEAF_MODELS else ecosystem.library_of(name)


def _built(name: str) -> tuple[Any, tuple, dict]:
    """(model, positional inputs, keyword inputs) of an ecosystem or a leaf model."""
    from fxopt.models_zoo import ecosystem, leaves

    if name in LEAF_MODELS:
        model, inputs = getattr(leaves, LEAF_MODELS[name][1])()
        return (model, (), inputs) if isinstance(inputs, dict) else (model, inputs, {})
    entry = ecosystem.get(name)
    args, kwargs = entry.inputs(entry.default_batch)
    return entry.build(), args, kwargs


def _quiet_libraries() -> None:
    """Silence the libraries' info and warning logs (they would bury the results)."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for logger in ("transformers", "diffusers", "timm", "monai"):
        logging.getLogger(logger).setLevel(logging.ERROR)


def run_in_subprocess(name: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", name, "--budget", args.budget]
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
        tail = done.stderr.strip().splitlines() or ["no output"]
        return {"model": name, "outcome": "crash", "raw": True,
                "detail": f"worker exited with {done.returncode}: {tail[-1]}"[:300],
                "traceback": tail[-TRACEBACK_LINES:],
                "seconds": round(time.perf_counter() - started, 1)}
    return json.loads(lines[-1])


# ---------------------------------------------------------------- the table

def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / MIB:.2f}"


def _outcome(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return row.get("outcome", "-")
    outcome = row[key]["outcome"]
    expected = EXPECTED.get(row["model"])
    if expected and outcome == expected[0] and expected[1] in row[key].get("message", ""):
        return f"{outcome} (expected)"
    return outcome


def raw_exceptions(row: dict[str, Any]) -> list[tuple[str, str]]:
    """``(where, last traceback line)`` for each non-fxopt exception the row records."""
    found = []
    if row.get("raw"):
        found.append(("worker", (row.get("traceback") or [row.get("detail", "")])[-1]))
    for key in ("default", "budget"):
        if row.get(key, {}).get("raw"):
            found.append((key, row[key]["traceback"][-1]))
    for error in row.get("measure_errors", []):
        if error.get("raw"):
            found.append((f"measure {error['what']}", error["traceback"][-1]))
    return found


HEADER = (f"{'library':<12} {'model':<36} {'frontend':<14} {'default':<24} {'budget':<20} "
          f"{'act MiB before':>14} {'default':>8} {'budget':>8} {'peak MiB before':>15} "
          f"{'default':>8} {'budget':>8} {'opt s':>6} {'budget s':>8}")


def format_row(row: dict[str, Any]) -> str:
    line = (f"{row.get('library', '?'):<12} {row['model']:<36} {row.get('frontend', '-'):<14} "
            f"{_outcome(row, 'default'):<24} {_outcome(row, 'budget'):<20} "
            f"{_mib(row.get('before_act')):>14} {_mib(row.get('default_act')):>8} "
            f"{_mib(row.get('budget_act')):>8} {_mib(row.get('before_peak')):>15} "
            f"{_mib(row.get('default_peak')):>8} {_mib(row.get('budget_peak')):>8} "
            f"{row.get('default', {}).get('seconds', 0):>6.1f} "
            f"{row.get('budget', {}).get('seconds', 0):>8.1f}")
    notes = [row["detail"]] if row.get("detail") else []
    for key in ("default", "budget"):
        result = row.get(key, {})
        if result.get("outcome") not in (None, "equal"):
            notes.append(f"{key}: {result['outcome']}: {result.get('detail', '')}")
        if result.get("rounding"):
            notes.append(f"{key}: {result['rounding']} float32 difference(s) shown to be "
                         "rounding (equal in float64, no less accurate)")
    notes += [f"leaf: {leaf}" for leaf in row.get("default", {}).get("leaves", [])]
    notes += [f"leaf_modules: {', '.join(row['leaf_modules'])}"] if row.get("leaf_modules") else []
    if row.get("leaf_modules") or row.get("default", {}).get("leaves"):
        notes += [f"{key}: train peak predicted {_mib(row[key]['predicted_peak']).strip()} MiB, "
                  f"measured {_mib(row.get(f'{key}_peak')).strip()} MiB"
                  + (" (equal to the byte)" if row[key]["predicted_peak"] == row.get(f"{key}_peak")
                     else f" ({row[key]['predicted_peak'] - row.get(f'{key}_peak', 0):+,} bytes)")
                  for key in ("default", "budget")
                  if row.get(key, {}).get("predicted_peak") is not None
                  and row.get(f"{key}_peak") is not None]
    notes += [f"measure {e['what']}: {e['outcome']}: {e['detail']}"
              for e in row.get("measure_errors", [])]
    notes += [f"raw exception ({where}): {last}" for where, last in raw_exceptions(row)
              if where != "worker"]
    return line + "".join(f"\n    {note}" for note in notes)


def _arrow(before: Any, after: Any) -> str:
    return f"{_mib(before).strip()} → {_mib(after).strip()}" if after is not None else (
        _mib(before).strip() or "-")


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The results as a Markdown table (for docs/coverage.md), under the run's header."""
    lines = ["```text", header, "```", "",  # tests/test_readme.py: every block is tagged
             "| library | model | frontend | default pipeline | budget | activations at peak, "
             "MiB: before → budget | training peak, MiB: before → budget | optimize s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        frontend = row.get("frontend", "-")
        leaves = row.get("default", {}).get("leaves", [])
        if leaves:
            frontend = f"{frontend} ({len(leaves)} leaves)"
        lines.append(
            f"| {row.get('library', '?')} | {row['model']} | {frontend} | "
            f"{_outcome(row, 'default')} | {_outcome(row, 'budget')} | "
            f"{_arrow(row.get('before_act'), row.get('budget_act'))} | "
            f"{_arrow(row.get('before_peak'), row.get('budget_peak'))} | "
            f"{row.get('default', {}).get('seconds', 0):.1f} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict[str, Any]], skipped: list[tuple[str, str]]) -> str:
    built = [r for r in rows if "default" in r]
    captured = sum(r.get("frontend", "-") != "-" for r in built)
    equal = sum(r["default"]["outcome"] == "equal" for r in built)
    budget_ok = sum(r["budget"]["outcome"] in ("equal", "budget-unreachable") for r in built
                    if "budget" in r)
    expected = sum(_outcome(r, "default").endswith("(expected)") for r in built)
    raw = [(r["model"], where, last) for r in rows for where, last in raw_exceptions(r)]
    others = {}
    for row in rows:
        if "default" not in row:
            others[row["outcome"]] = others.get(row["outcome"], 0) + 1
    lines = [f"{len(rows)} models: {captured} captured / {equal} equal (default) / {budget_ok} "
             f"equal-or-budget-unreachable (budget) / {len(raw)} raw exceptions"
             + (f"; {expected} failed as expected" if expected else "")
             + "".join(f"; {n} {outcome}" for outcome, n in sorted(others.items()))]
    lines += [f"  raw exception: {model} ({where}): {last}" for model, where, last in raw]
    lines += [f"  skipped {what}: {why}" for what, why in skipped]
    return "\n".join(lines)


def results_header(args: argparse.Namespace, todo: int, done: int) -> str:
    import torch

    from fxopt.bench.environment import code_commit, device_name

    torch.set_num_threads(1)  # as every worker runs
    versions = []
    for library, distribution in DISTRIBUTIONS.items():
        try:
            versions.append(f"{library} {metadata.version(distribution)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{library} not installed")
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    return (f"fxopt ecosystem coverage sweep; {datetime.date.today().isoformat()}; fxopt "
            f"{code_commit() or '(commit unknown)'}; "
            f"device: {device_name(torch.device('cpu'))} per model, "
            f"{args.jobs} at once; torch {torch.__version__}; {', '.join(versions)}\n"
            f"budget {args.budget}; {todo} to run, {done} already done; command: {command}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--library", default=None,
                        help="only this library's models: transformers, diffusers, smp, monai "
                        "or timm")
    parser.add_argument("--limit", type=int, default=0, help="run at most N models")
    parser.add_argument("--out", default="", help="write the results table here")
    parser.add_argument("--json", default="", help="write the results here as they arrive")
    parser.add_argument("--markdown", default="", help="also write the table as Markdown here")
    parser.add_argument("--resume", action="store_true", help="skip models already in --json")
    parser.add_argument("--budget", default="min",
                        help="memory_budget of the second run: min (the least memory), a "
                        "fraction of the activation memory, bytes or a size such as 300MB "
                        "(default min)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per model")
    parser.add_argument("--jobs", type=int, default=1,
                        help="models run at once, each in its own one-thread subprocess "
                        "(measured memory is exact either way; seconds are less so above the "
                        "number of cores)")
    parser.add_argument("--list", action="store_true", help="print the model names and exit")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # worker mode
    args = parser.parse_args()

    if args.one:
        print(json.dumps(run_one(args.one, args.budget)))
        return

    from fxopt.models_zoo import ecosystem

    skipped = ecosystem.skipped(args.library)
    if args.models:
        names = args.models.split(",")
        skipped = [(what, why) for what, why in skipped
                   if what in names or what in {ecosystem.library_of(n) for n in names}]
        unavailable = {what for what, _ in skipped}
        names = [n for n in names if n not in unavailable
                 and _library_of(n) not in unavailable]
    else:
        names = ecosystem.names(args.library) + [
            n for n, (library, _, _) in LEAF_MODELS.items()
            if args.library in (None, library) and (library == "torch"
                                                    or ecosystem.installed(library))]
    if args.list:
        print("\n".join(names))
        print("\n".join(f"skipped {what}: {why}" for what, why in skipped), file=sys.stderr)
        return
    rows: list[dict[str, Any]] = []
    out_json = Path(args.json) if args.json else None
    if out_json and args.resume and out_json.exists():
        rows = [r for r in json.loads(out_json.read_text())["rows"] if r["model"] in names]
    done = {r["model"] for r in rows}
    todo = [n for n in names if n not in done]
    if args.limit:
        todo = todo[:args.limit]

    header = results_header(args, len(todo), len(done))
    print(header, flush=True)
    for what, why in skipped:
        print(f"skipped {what}: {why}", flush=True)
    print(HEADER, flush=True)

    def write_out(final: bool) -> None:
        if args.out:
            table = "\n".join([header, HEADER, *(format_row(r) for r in rows)])
            tail = summary(rows, skipped) if final else "(sweep in progress)"
            Path(args.out).write_text(f"{table}\n{tail}\n")

    for row in rows:
        print(format_row(row), flush=True)
    order = {name: i for i, name in enumerate(names)}
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        for row in pool.map(lambda name: run_in_subprocess(name, args), todo):
            rows.append(row)
            rows.sort(key=lambda r: order.get(r["model"], len(order)))
            print(format_row(row), flush=True)
            if out_json:
                out_json.write_text(json.dumps({"budget": args.budget, "rows": rows}, indent=1))
            write_out(final=False)
    write_out(final=True)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, header) + "\n" + summary(rows, skipped)
                                       + "\n")
    print(summary(rows, skipped), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
