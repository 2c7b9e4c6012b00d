"""The CUDA tests' bodies run on the CPU, before a GPU session spends device minutes on them.

    python benchmarks/cuda_tests_on_cpu.py

A GPU session has a few minutes of device time, and ``cuda_suite.py`` runs every CUDA test in one
pytest process. A mistake in a test body that only a device reaches costs that whole part: token
ids past a model's vocabulary are a device-side assert on a GPU, which poisons the CUDA context
for every later test. This runs the same tests (``cuda_suite.cuda_tests()``) on the CPU, with
their skip markers dropped and ``.cuda()`` a no-op, so each body runs until it needs the device,
and sorts each failure:

- ``needs the device``: torch found no driver, or fxopt said no CUDA device is available;
- ``took the CPU's path``: an assertion about what only a GPU does failed (the allocator's
  figures, a proof on CPU copies), or an error the test expects from the GPU path did not come;
- ``look at it``: anything else (an ``IndexError``, a ``TypeError``, a ``NameError``): a failure
  the GPU would see too.

Exit status 1 when a test is in the last group; 2, running nothing, where a CUDA device is
present (run the tests there for real). What it cannot see: a mistake after the first
line that needs the device (the body stops there), and device-only arguments (``device="cuda"``
stays a CUDA device and stops the body).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from cuda_suite import cuda_tests  # noqa: E402

NEEDS_DEVICE = ("Found no NVIDIA driver", "no CUDA device is available",
                "Torch not compiled with CUDA")
CPU_PATH = ("AssertionError", "assert ", "Failed: DID NOT RAISE")
GROUPS = ("needs the device", "took the CPU's path", "look at it")


def group_of(message: str) -> str:
    """Which group a failure's one-line message (pytest's crash line) puts it in."""
    if any(marker in message for marker in NEEDS_DEVICE):
        return GROUPS[0]
    if message.startswith(CPU_PATH):
        return GROUPS[1]
    return GROUPS[2]


class OnTheCpu:
    """A pytest plugin: skip markers dropped, ``.cuda()`` a no-op, each failure recorded."""

    def __init__(self) -> None:
        self.failures: dict[str, list[tuple[str, str]]] = defaultdict(list)
        self.passed: list[str] = []

    def pytest_configure(self, config) -> None:
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        torch.nn.Module.cuda = lambda self, *args, **kwargs: self

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            item.own_markers = [m for m in item.own_markers if m.name != "skipif"]

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and not report.failed:
            return
        if report.passed:
            self.passed.append(report.nodeid)
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message.splitlines()[0] if crash is not None else str(report.longrepr)
            self.failures[group_of(message)].append((report.nodeid, message[:160]))


def main() -> int:
    if torch.cuda.is_available():
        print("a CUDA device is here: run the CUDA tests on it (benchmarks/cuda_suite.py)")
        return 2
    plugin = OnTheCpu()
    pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "-rN", *cuda_tests()],
                plugins=[plugin])
    print(f"\n{len(plugin.passed)} ran through on the CPU")
    for group in GROUPS:
        found = plugin.failures.get(group, [])
        print(f"{group}: {len(found)}")
        for nodeid, message in found:
            print(f"  {nodeid}\n      {message}")
    return 1 if plugin.failures.get(GROUPS[2]) else 0


if __name__ == "__main__":
    sys.exit(main())
