"""Where a benchmark ran, as its tables name it: the device and the threads torch used, the
commit of the code, and a printer that also keeps the ``--out`` file."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from pathlib import Path

import torch


def device_name(device: torch.device | str) -> str:
    """``"NVIDIA H100 ... (CUDA)"`` or ``"CPU <model name>, <n> threads"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"CPU {cpu}, {threads} thread{'s' if threads != 1 else ''}"


def imported_checkout() -> Path:
    """The folder holding the ``fxopt`` package this process imported: with ``PYTHONPATH``
    pointing at another worktree (an A/B of two commits), that worktree, not the checkout of
    the script that runs. This module is part of that package: fxopt/bench/environment.py."""
    return Path(__file__).resolve().parents[2]


def code_commit(root: Path | None = None, paths: tuple[str, ...] = ("fxopt", "passes")
                ) -> str | None:
    """``"<short sha>"``, or ``"<short sha>+changes"`` when tracked files under ``paths`` (of
    the checkout at ``root``, by default the imported fxopt's: ``imported_checkout``) differ
    from it: the code a benchmark's figures belong to. None where ``root`` is no git checkout
    (or git is missing)."""
    root = imported_checkout() if root is None else root
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                *paths], cwd=root, text=True, capture_output=True, timeout=10,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}{'+changes' if dirty else ''}"


class TeeOutput:
    """Prints each line, and keeps the file given (a benchmark's ``--out``) up to date line by
    line, so a run cut short leaves its figures so far."""

    def __init__(self, path: str | Path | None):
        self.file = open(path, "w") if path else None  # noqa: SIM115 -- open for the whole run

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def header(script: str | Path, device: str, *details: str) -> list[str]:
    """A results file's first lines: the script, the date, the device, torch's version and
    ``details`` (other libraries' versions), the code's commit, then the command as run."""
    script = Path(script).resolve()
    about = "; ".join((f"device: {device}", f"torch {torch.__version__}", *details,
                       f"code {code_commit()}"))
    return [f"# benchmarks/{script.name} -- {datetime.date.today()}; {about}",
            f"# command: python benchmarks/{script.name} {' '.join(sys.argv[1:])}".rstrip()]
