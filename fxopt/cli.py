"""``fxopt`` command line: argparse -> API -> printed table. No logic of its own.

Exit codes: 0 ok, 1 equivalence mismatch, 2 usage, input or trace error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fxopt.api import optimize
from fxopt.errors import EquivalenceError, FxoptError
from fxopt.targets import DTYPES, load_target, parse_shape


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="zoo:NAME, path/to/file.py:ClassOrFactory or "
                        "package.module:factory")
    parser.add_argument("--input-shape", type=parse_shape, default=None,
                        help="shape of the example input, e.g. 8,3,224,224 (zoo models have one)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--weights", help="a state_dict saved with torch.save")
    parser.add_argument("--passes", default=None,
                        help="e.g. inplace,checkpoint{budget=0.5},reorder (default: all defaults)")
    parser.add_argument("--memory-budget", default=None,
                        help="bytes, '2GiB', '300MB' or a fraction of activation memory")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxopt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("optimize", help="rewrite a model, verify it, print before/after memory")
    _add_target_args(opt)
    opt.add_argument("--out", help="write report.json (and later the exported module) here")
    opt.add_argument("--no-verify", action="store_true", help="skip the equivalence check")
    return parser


def _budget(text: str | None) -> int | float | str | None:
    if text is None:
        return None
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def _optimize(args: argparse.Namespace) -> int:
    model, inputs = load_target(args.target, input_shape=args.input_shape, dtype=args.dtype,
                                weights=args.weights)
    gm = optimize(model, inputs, passes=args.passes, memory_budget=_budget(args.memory_budget),
                  verify=not args.no_verify, measure_memory=True)
    report = gm.fxopt_report
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
        print(f"wrote {out / 'report.json'}")
    return 0


COMMANDS = {"optimize": _optimize}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except EquivalenceError as error:
        if args.debug:
            raise
        print(f"fxopt: {error}", file=sys.stderr)
        return 1
    except FxoptError as error:
        if args.debug:
            raise
        print(f"fxopt: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
