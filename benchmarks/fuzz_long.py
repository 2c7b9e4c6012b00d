"""The long fuzzing run: tests/test_fuzz.py under the hypothesis profile "long".

    python benchmarks/fuzz_long.py [--examples N] [--seed S] [--json OUT]

Runs the same properties as CI (random models through every pass combination and random
budgets: a verified-equal module or a BudgetError, never anything else; see tests/test_fuzz.py),
with random seeds and N examples per property instead of CI's fixed few hundred. Prints how many
distinct examples ran, their outcome counts (equal, rounding re-checked, BudgetError) and how often each pass changed the graph; a failure prints hypothesis' shrunk reproducer.
Exit status: pytest's (0 when every example held).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples per property")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default random)")
    parser.add_argument("--json", default="", help="also write the outcome counts here")
    args = parser.parse_args()

    import pytest
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        counts_file = Path(tmp) / "outcomes.json"
        os.environ["FXOPT_HYPOTHESIS_PROFILE"] = "long"
        os.environ["FXOPT_FUZZ_EXAMPLES"] = str(args.examples)
        os.environ["FXOPT_FUZZ_OUTCOMES"] = str(counts_file)
        pytest_args = [str(ROOT / "tests" / "test_fuzz.py"), "-q", "-p", "no:cacheprovider",
                       "-p", "no:logging", "-k", "not fixed_bug", "--hypothesis-show-statistics"]
        if args.seed is not None:
            pytest_args.append(f"--hypothesis-seed={args.seed}")
        started = time.perf_counter()
        status = pytest.main(pytest_args)
        seconds = time.perf_counter() - started
        counts = json.loads(counts_file.read_text()) if counts_file.exists() else {}
    total = counts.get("examples", 0)
    print(f"\nfuzz_long: {total} distinct examples in {seconds:.0f} s (seed "
          f"{args.seed if args.seed is not None else 'random'}, up to {args.examples} per "
          f"property); pytest exit status {int(status)}")
    for name, count in sorted(counts.get("outcomes", {}).items()):
        print(f"  {name:<60} {count:>6}")
    print("graphs changed by: " + ", ".join(
        f"{k}={v}" for k, v in sorted(counts.get("changed_by", {}).items())))
    if args.json:
        Path(args.json).write_text(json.dumps({**counts, "seconds": seconds,
                                               "status": int(status)}, indent=1))
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
