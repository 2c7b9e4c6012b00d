"""Seconds per test file, from a pytest junit report, as ``tests/data/file_seconds.json``.

``tests/conftest.py`` hands test files to pytest-xdist's workers longest first, so that the last
files a worker takes are short ones and both of CI's cores finish together (longest processing
time first). The figures only order the files: a stale table makes the suite no less complete,
only its two workers less evenly loaded. Regenerate it when files are added or change much::

    .venv/bin/python -m pytest -q -n auto --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python benchmarks/suite_durations.py /tmp/junit.xml
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "file_seconds.json"


def file_seconds(junit: Path) -> dict[str, float]:
    """Each test file's summed test times (setup, call and teardown), longest first."""
    seconds: Counter = Counter()
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((part for part in module if part.startswith("test_")), None)
        if name is not None:
            seconds[f"{name}.py"] += float(case.get("time") or 0.0)
    return {name: round(value, 1) for name, value in seconds.most_common()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, help="a pytest --junitxml report of the whole suite")
    parser.add_argument("--out", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    table = file_seconds(args.junit)
    if not table:
        parser.error(f"{args.junit} holds no test of a tests/test_*.py file")
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s in all -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
