"""``fxopt`` command line: argparse -> API -> printed table. No logic of its own.

Subcommands: ``optimize`` (rewrite, verify, compare, export), ``report`` (memory breakdown,
lints, memory plot), ``check`` (the CI equivalence gate), ``bench`` (original vs fxopt vs peers).
Errors are one block -- what, where, what to do -- without a traceback unless ``--debug``.
JSON documents carry a ``schema`` key: ``fxopt.check/1`` (``fxopt.check``), ``fxopt.report/1``
(``report --json``), ``fxopt.optimize/1`` (``optimize --out``'s report.json), ``fxopt.bench/1``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DESCRIPTION = """\
fxopt rewrites a PyTorch model to use less memory (in-place activations, activation
checkpointing under a memory budget, channel padding, memory-aware reordering), proves the
rewritten model computes the same function, and measures what it saves."""

EPILOG = """\
TARGET is zoo:NAME (a models_zoo model), eco:NAME (a Hugging Face, diffusers, smp, monai or timm
model; the test extra), path/to/file.py:NAME or package.module:NAME. NAME is a module class or a
function called without arguments that returns a module, (model, inputs), (model, kwargs_dict)
or (model, args, kwargs).

example inputs (one of; zoo, eco and factory targets bring their own):
  --input-shape 8,3,224,224                 one float tensor (--dtype sets its dtype)
  --input 2,16:int64:0-1000 --input 2,16    several positional tensors, in order
  --input input_ids=4,256:int64:0-50257 --input labels=@input_ids
                                            keyword inputs (NAME=), token ids in [0, 50257),
                                            labels the same tensor as input_ids
  --inputs inputs.pt                        torch.save'd tensor, tuple or dict of keyword inputs

exit codes:
  0  ok (check: every run matched)
  1  equivalence mismatch: the optimized model computes something else
  2  usage, input, trace, configuration, budget or export error (the message says what to do)
  3  internal error: a bug in fxopt, export bugs included (rerun with --debug and report the
     traceback); a failed export leaves no --out folder, and an existing one as it was
"""


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser raising InputError: argparse prints it and exits 2."""
    def convert(text: str) -> Any:
        from fxopt.core.errors import InputError
        try:
            return parse(text)
        except InputError as error:
            raise argparse.ArgumentTypeError(f"{error.what} ({error.hint})") from None
    convert.__name__ = parse.__name__
    return convert


def _shape(text: str) -> tuple[int, ...]:
    from fxopt.cli.inputs import parse_shape
    return _argument_type(parse_shape)(text)


def _input_spec(text: str) -> Any:
    from fxopt.cli.inputs import parse_input_spec
    return _argument_type(parse_input_spec)(text)


def _int_range(text: str) -> tuple[int, int]:
    from fxopt.cli.inputs import parse_int_range
    return _argument_type(parse_int_range)(text)


def _module_paths(text: str) -> tuple[str, ...]:
    paths = tuple(part.strip() for part in text.split(",") if part.strip())
    if not paths or not all(p.replace(".", "").replace("_", "").isalnum() for p in paths):
        raise argparse.ArgumentTypeError(f"expected module paths like blocks.0.moe,blocks.1.moe, "
                                         f"got {text!r}")
    return paths


def _leaf_modules(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--leaf-modules", type=_module_paths, default=(), metavar="PATHS",
                        help="submodules to keep as opaque calls, comma-separated module paths "
                             "(blocks.0.moe,blocks.1.moe): fxopt.optimize's leaf_modules=. A "
                             "leaf that reads tensor values is run for real on the example "
                             "inputs, and predicted, planned and checkpointed from that run")


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _optimizer_class(text: str) -> type:
    import torch
    classes = {name.lower(): getattr(torch.optim, name) for name in dir(torch.optim)
               if isinstance(getattr(torch.optim, name), type)
               and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
               and name != "Optimizer"}
    if text.lower() not in classes:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no torch.optim optimizer; one of {', '.join(sorted(classes))}")
    return classes[text.lower()]


def _budget(text: str | None) -> int | float | str | None:
    if text is None:
        return None
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def _common(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    parser.add_argument("target", nargs="+" if several else None,
                        help="zoo:NAME, eco:NAME (Hugging Face, diffusers, smp, monai, timm "
                             "models; the test extra), path/to/file.py:ClassOrFactory or "
                             "package.module:factory")
    inputs = parser.add_argument_group(
        "example inputs", "one of these; zoo, eco and factory targets bring their own")
    inputs.add_argument("--input-shape", type=_shape, default=None, metavar="SHAPE",
                        help="one positional tensor of --dtype, e.g. 8,3,224,224 (for zoo and "
                             "factory targets it replaces the first input; for eco targets only "
                             "the batch size is read)")
    inputs.add_argument("--input", type=_input_spec, action="append", default=None,
                        dest="input_specs", metavar="[NAME=]SHAPE[:DTYPE[:LOW-HIGH]]",
                        help="a tensor, repeatable: positional in the order given, or the "
                             "keyword argument NAME; DTYPE default --dtype (also int32, bool); "
                             "LOW-HIGH draws values in [LOW, HIGH), e.g. "
                             "input_ids=4,256:int64:0-50257; NAME=@OTHER reuses input OTHER "
                             "(labels=@input_ids)")
    inputs.add_argument("--inputs", default=None, metavar="FILE",
                        help="example inputs saved with torch.save: a tensor, a tuple of "
                             "forward's positional arguments, or a dict of keyword arguments "
                             "(input_ids=..., labels=...)")
    inputs.add_argument("--int-range", type=_int_range, default=None, metavar="LOW,HIGH",
                        help="range [LOW, HIGH) of integer tensors drawn without one of their "
                             "own, e.g. 0,50257 for token ids (default 0,2: zeros and ones)")
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "float16", "bfloat16", "float64", "int64"],
                        help="float16, bfloat16 and float64 cast the model and every float input; "
                             "also the dtype of --input-shape's tensor and of --input specs that "
                             "name none (int64: token ids, see --int-range); default float32")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda or cuda:N: the model and inputs are moved "
                             "there; on CUDA memory is read from the caching allocator")
    parser.add_argument("--threads", type=_positive, default=None, metavar="N",
                        help="torch CPU threads (torch.set_num_threads) while fxopt runs; "
                             "default torch's own. Pin it for steadier step times")
    parser.add_argument("--weights", help="a state_dict saved with torch.save")
    parser.add_argument("--passes", default=None,
                        help="e.g. 'inplace,checkpoint{budget=0.5},reorder' (quote it: the "
                             "shell expands braces); default: every default pass")
    parser.add_argument("--memory-budget", default=None,
                        help="bytes, '2GiB', '300MB', a fraction of activation memory (0.5), or "
                             "'min' (the least memory checkpointing reaches)")
    parser.add_argument("--capture", default="auto", choices=["auto", "fx", "export"],
                        help="how to capture the model: fx (symbolic tracing), export "
                             "(torch.export), or auto (fx when it captures the whole model, "
                             "else export, else fx with opaque leaves; the default)")
    parser.add_argument("--static-shapes", dest="dynamic", action="store_false",
                        help="torch.export captures the example's sizes only (2 traces instead "
                             "of 3, each faster); the module then refuses other batch and "
                             "sequence sizes. For training at one fixed shape: "
                             "fxopt.optimize's dynamic=False")
    parser.add_argument("--fuse-optimizer", default=None, type=_optimizer_class, metavar="NAME",
                        help="a torch.optim optimizer (adamw, sgd, ...) your training fuses into "
                             "backward with fxopt.fuse_optimizer: memory is planned and "
                             "predicted with each gradient freed at its step")
    parser.add_argument("--progress", action="store_true",
                        help="tell each phase (capture, predict, each pass, verify, measure) and "
                             "its time on stderr even when it is not a terminal (on a terminal, "
                             "a status line shows them anyway; FXOPT_PROGRESS=1 does the same, "
                             "FXOPT_PROGRESS=0 silences it)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxopt", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=summary, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    opt = command("optimize", "rewrite a model, verify it, print before/after memory and time, "
                              "and export it (--out) as a folder that loads with plain torch")
    _common(opt)
    _leaf_modules(opt)
    opt.add_argument("--out", help="write the exported module, its weights and report.json here")
    opt.add_argument("--no-verify", action="store_true", help="skip the equivalence check")
    opt.add_argument("--verify-at", choices=("auto", "full", "reduced", "cpu"), default="auto",
                     help="where the equivalence check runs: auto (default) at the example size "
                          "where the original's step fits, else a smaller batch or the CPU; "
                          "full, reduced (a smaller batch) or cpu")
    opt.add_argument("--outputs", choices=("all", "loss"), default="all",
                     help="loss: the training loop reads only the loss (as Hugging Face's "
                          "Trainer does), so logits the model only returns are not built; all "
                          "(default) returns every output")
    opt.add_argument("--check-budget", action=argparse.BooleanOptionalAction, default=None,
                     help="measure a real step of the planned module and plan again while it "
                          "is over --memory-budget (default: on a GPU, off on the CPU)")
    opt.add_argument("--repeats", type=_positive, default=5,
                     help="timed training steps per model: at least this many (default 5), more "
                          "until each model has run 1 s")

    rep = command("report", "memory breakdown, lints from common PyTorch memory advice and "
                            "memory.png (memory over a training step, before and after "
                            "optimization); writes no model")
    _common(rep)
    _leaf_modules(rep)
    rep.add_argument("--for-inference", action="store_true",
                     help="the model is meant for inference: flag layers left in train mode")
    rep.add_argument("--plot", default="memory.png", help="where to draw (default memory.png)")
    rep.add_argument("--no-plot", action="store_true", help="draw nothing (no matplotlib needed)")
    rep.add_argument("--top", type=_positive, default=8, help="saved tensors to list (default 8)")
    rep.add_argument("--json", action="store_true",
                     help="print JSON instead of text (schema fxopt.report/1)")

    chk = command("check", "the CI equivalence gate: optimize, then verify outputs, gradients "
                           "and buffers on several random inputs (and batch sizes)")
    _common(chk)
    _leaf_modules(chk)
    chk.add_argument("--seeds", type=_ints, default=[0, 1], help="e.g. 0,1,2 (default 0,1)")
    chk.add_argument("--batch-sizes", type=_ints, default=None, help="e.g. 1,4")
    chk.add_argument("--json", action="store_true",
                     help="print the result as JSON (schema fxopt.check/1, see fxopt.check)")

    ben = command("bench", "peak memory and step time of the original vs fxopt vs peers, for "
                           "one or several targets and budgets")
    _common(ben, several=True)
    ben.add_argument("--budgets", default=None,
                     help="several budgets to compare, e.g. 0.3,0.5,0.7 (else --memory-budget)")
    ben.add_argument("--peers", default=None,
                     help="comma-separated, or none (default: checkpoint_sequential,"
                          "torch_compile_min_cut)")
    ben.add_argument("--repeats", type=_positive, default=5,
                     help="timed training steps per variant: at least this many (default 5), "
                          "more until each has run 1 s")
    ben.add_argument("--json", action="store_true",
                     help="print JSON instead of a table (schema fxopt.bench/1)")
    return parser


def _load(args: argparse.Namespace, target: str | None = None) -> tuple[Any, tuple]:
    from fxopt.cli.targets import load_target
    model, inputs = load_target(target or args.target, input_shape=args.input_shape,
                                dtype=args.dtype, weights=args.weights, inputs_file=args.inputs,
                                input_specs=args.input_specs, int_range=args.int_range,
                                device=args.device)
    args.fused_optimizer = None  # what each command hands to optimize and the estimates
    if getattr(args, "fuse_optimizer", None) is not None:
        from fxopt.runtime.fuse import fuse_optimizer
        # the plan does not depend on lr
        args.fused_optimizer = fuse_optimizer(model, args.fuse_optimizer, lr=1e-3)
    return model, inputs


_BARS: list[Any] = []  # progress bars to end cleanly when an error stops the work


def _progress(title: str) -> Any:
    from fxopt.cli.progress import Progress
    _BARS.append(Progress(title))
    return _BARS[-1]


OPTIMIZE_SCHEMA = "fxopt.optimize/1"
REPORT_SCHEMA = "fxopt.report/1"
BENCH_SCHEMA = "fxopt.bench/1"


def _describe_inputs(inputs: tuple) -> list[Any]:
    return [list(t.shape) if hasattr(t, "shape") else repr(t) for t in inputs]


def _check_writable(out: str) -> None:
    """Refuse an ``--out`` that cannot be written before any work, so that a long run is never
    lost at its end: a file in its place or on its path, or a folder that takes no files."""
    import os
    import tempfile

    from fxopt.core.errors import InputError

    path = Path(out).absolute()
    hint = "give a folder to export to (new, or one to add the export to) that you can write"
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {out} is a file, not a folder", where="--out", hint=hint)
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--out {out} cannot be made: {existing} is a file", where="--out",
                         hint=hint)
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".fxopt-write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise InputError(f"--out {out} cannot be written: {error.strerror or error} in "
                         f"{existing}", where="--out", hint=hint) from None


def _optimize(args: argparse.Namespace) -> int:
    from fxopt.api import optimize
    from fxopt.bench.before_after import before_after
    from fxopt.export.writer import export

    if args.out:
        _check_writable(args.out)
    model, inputs = _load(args)
    progress = _progress("fxopt optimize")
    steps = 3 if args.out else 2
    progress(0, steps, "optimizing")
    gm = optimize(model, inputs, passes=args.passes, memory_budget=_budget(args.memory_budget),
                  verify=False if args.no_verify else args.verify_at, capture=args.capture,
                  fused_optimizer=args.fused_optimizer, leaf_modules=args.leaf_modules,
                  outputs=args.outputs, check_budget=args.check_budget, dynamic=args.dynamic)
    progress(1, steps, "measuring")
    comparison = before_after(model, gm, inputs, repeats=args.repeats)
    if args.out:
        progress(2, steps, "exporting")
        try:  # all or nothing: a failed export leaves no folder (fxopt.export.writer)
            result = export(gm, args.out, example_inputs=inputs)
        except Exception:  # what the optimization achieved, then the export's own error
            progress.close()
            print(gm.fxopt_report)
            print(comparison)
            raise
    progress(steps, steps, "done")
    print(gm.fxopt_report)
    print(comparison)
    if args.out:
        document = {"schema": OPTIMIZE_SCHEMA, "target": args.target,
                    "input_shapes": _describe_inputs(inputs),
                    **gm.fxopt_report.as_dict(), "comparison": comparison.as_dict(),
                    "export": result.as_dict()}
        (Path(args.out) / "report.json").write_text(json.dumps(document, indent=2, default=str))
        print(result)
        print(f"wrote {Path(args.out) / 'report.json'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from fxopt.api import optimize
    from fxopt.capture.reuse import capture_model, reusable
    from fxopt.measure.advice import grouped, run_lints
    from fxopt.measure.breakdown import memory_breakdown
    from fxopt.measure.plot import missing_matplotlib, plot_timelines
    from fxopt.measure.timeline import training_timeline

    model, inputs = _load(args)
    no_plot = None if args.no_plot else missing_matplotlib()  # only the plot needs matplotlib
    draw = not (args.no_plot or no_plot)
    progress = _progress("fxopt report")
    steps = 4 if draw else 2
    progress(0, steps, "capturing")
    traced = capture_model(model, inputs, capture=args.capture, leaf_modules=args.leaf_modules,
                           dynamic=args.dynamic)
    progress(1, steps, "measuring")
    breakdown = memory_breakdown(model, inputs, gm=traced, fused_optimizer=args.fused_optimizer)
    lints = run_lints(traced, inputs, for_inference=args.for_inference)
    if not args.json:
        progress.close()
        print(breakdown.format(top=args.top))
        shown = grouped(lints)  # one entry for what many layers share
        groups = f" in {len(shown)} groups" if len(shown) < len(lints) else ""
        print(f"lints ({len(lints)}{groups}):" if lints else "lints: none")
        for lint in shown:
            print("  " + str(lint).replace("\n", "\n  "))
    timelines = []
    if no_plot:
        progress.close()
        print(no_plot, file=sys.stderr if args.json else sys.stdout)
    if draw:
        progress(2, steps, "optimizing")
        optimized = optimize(model, inputs, passes=args.passes,
                             memory_budget=_budget(args.memory_budget), capture=args.capture,
                             fused_optimizer=args.fused_optimizer,
                             leaf_modules=args.leaf_modules, dynamic=args.dynamic,
                             captured=traced if reusable(traced) else None)  # one capture
        progress(3, steps, "timelines")
        timelines = [training_timeline(model, inputs, label="before"),
                     training_timeline(optimized, inputs, label="after fxopt")]
        path = plot_timelines(timelines, args.plot, title=f"{args.target}: one training step")
        peaks = ", ".join(f"{t.label} peak {t.peak_bytes / 2**20:.1f} MiB" for t in timelines)
        progress(4, steps, "done")
        print(f"wrote {path} ({peaks})", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"schema": REPORT_SCHEMA, "target": args.target,
                          "breakdown": breakdown.as_dict(top=args.top),
                          "lints": [lint.as_dict() for lint in lints],
                          "timelines": [{k: v for k, v in t.as_dict().items()
                                         if k not in ("ops", "live_bytes")} for t in timelines]},
                         indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    from fxopt.check import check_equivalence

    model, inputs = _load(args)
    progress = _progress("fxopt check")
    result, _ = check_equivalence(model, inputs, passes=args.passes,
                                  memory_budget=_budget(args.memory_budget), seeds=args.seeds,
                                  batch_sizes=args.batch_sizes, capture=args.capture,
                                  progress=progress, fused_optimizer=args.fused_optimizer,
                                  leaf_modules=args.leaf_modules, dynamic=args.dynamic)
    result.target = args.target
    print(json.dumps(result.as_dict(), indent=2) if args.json else result)
    return 0 if result.ok else 1


def _bench(args: argparse.Namespace) -> int:
    from fxopt.bench.environment import device_name
    from fxopt.bench.runs import DEFAULT_PEERS, bench, check_peers, format_table
    from fxopt.planning.budget import parse_budget

    budgets = [_budget(b) for b in args.budgets.split(",")] if args.budgets else [
        _budget(args.memory_budget)]
    for budget in budgets:  # every one readable before any model is loaded or timed
        if budget is not None:
            parse_budget(budget)
    peers = DEFAULT_PEERS if args.peers is None else tuple(
        p for p in args.peers.split(",") if p and p != "none")
    check_peers(peers)  # like the budgets: before any model is loaded
    jobs = [(target, budget) for target in args.target for budget in budgets]
    per_job = 3 + len(peers)
    progress = _progress("fxopt bench")
    results = []
    device = device_name(args.device)
    for index, (target, budget) in enumerate(jobs):
        model, inputs = _load(args, target)
        rows = bench(model, inputs, passes=args.passes, memory_budget=budget, peers=peers,
                     repeats=args.repeats, capture=args.capture,
                     fused_optimizer=args.fused_optimizer, dynamic=args.dynamic,
                     progress=lambda done, total, label, base=index * per_job: progress(
                         base + done, len(jobs) * per_job, f"{target} {label}"))
        results.append({"target": target, "memory_budget": budget,
                        "input_shapes": _describe_inputs(inputs),
                        "rows": [row.as_dict() for row in rows]})
        if not args.json:
            print(f"{target}, memory budget {budget or 'none'}:\n"
                  f"{format_table(rows, device)}\n")
    if args.json:
        from fxopt.bench.before_after import PEAK_DEFINITION
        print(json.dumps({"schema": BENCH_SCHEMA, "device": device,
                          "train_peak": PEAK_DEFINITION, "results": results}, indent=2))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "optimize": _optimize, "report": _report, "check": _check, "bench": _bench}


def _print_error(args: argparse.Namespace, error: Exception, code: int) -> None:
    from fxopt.check import SCHEMA

    for bar in _BARS:
        bar.close()
    print(f"fxopt: {error}", file=sys.stderr)
    for note in getattr(error, "__notes__", ()):  # torch's own log, with FXOPT_VERBOSE=1
        print(note, file=sys.stderr)
    if args.command == "check" and getattr(args, "json", False):
        print(json.dumps({"schema": SCHEMA, "ok": False, "target": args.target, "runs": [],
                          "error": {"type": type(error).__name__,
                                    "message": str(error), "exit_code": code}}, indent=2))


@contextlib.contextmanager
def _no_trainer_advice() -> Iterator[None]:
    """Without ``TrainerCheckpointWarning``: its advice
    (``callbacks=[fxopt.pretrained_checkpoints()]``) is for an optimized module a Python script
    hands to ``transformers.Trainer``, and no command hands one over (``optimize --out`` writes a
    folder that loads without fxopt)."""
    import warnings

    from fxopt.integrations.hf_trainer import TrainerCheckpointWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainerCheckpointWarning)
        yield


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from fxopt.core.errors import EquivalenceError, FxoptError
    from fxopt.core.torch_private import quiet_fake_tensor_logs

    # torch logs a traceback for each failed fake-tensor op; fxopt's own error says what failed
    from fxopt.cli.device import parse_device, torch_threads

    from fxopt.core import progress

    quiet = contextlib.nullcontext() if args.debug else quiet_fake_tensor_logs()
    target = args.target if isinstance(args.target, str) else ",".join(args.target)
    try:
        with quiet, torch_threads(args.threads), progress.shown(True if args.progress else None), \
                _no_trainer_advice():
            args.device = parse_device(args.device)
            with progress.phase(f"{args.command} {target}"):
                return COMMANDS[args.command](args)
    except EquivalenceError as error:
        if args.debug:
            raise
        _print_error(args, error, 1)
        return 1
    except FxoptError as error:  # a usage error (2), unless the error is a bug's (ExportBug: 3)
        if args.debug:
            raise
        code = getattr(error, "exit_code", 2)
        _print_error(args, error, code)
        return code
    except KeyboardInterrupt:
        for bar in _BARS:
            bar.close()
        print("fxopt: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a bug: one line and how to get the traceback
        if args.debug:
            raise
        for bar in _BARS:
            bar.close()
        print(f"fxopt: internal error: {type(error).__name__}: {error}\n"
              "  what to do: rerun with --debug for the traceback and report it", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
