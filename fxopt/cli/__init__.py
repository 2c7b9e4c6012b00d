"""The ``fxopt`` command line: argparse -> API -> printed table.

- ``commands``: subcommands optimize, check, report, bench.
- ``targets``: TARGET strings (``zoo:NAME``, ``eco:NAME``, ``file.py:Name``,
  ``package.module:factory``) to a model and its example inputs.
- ``inputs``: example inputs described by flags (``--input``, ``--input-shape``, ``--int-range``).
- ``device``: ``--device`` (checked, model and inputs moved) and ``--threads``.
- ``progress``: a progress bar drawn only on a terminal.
"""

from __future__ import annotations

import gc


THRESHOLDS = (10_000, 10, 100)


def collect_garbage_less_often() -> None:
    """Set this process's garbage collector for a run of torch and fxopt: the young generation
    collected every 10,000 allocations instead of 700 and a full collection after 100 of the
    middle generation's instead of 10 (``THRESHOLDS``). A full collection scans every object the
    process holds (torch's are millions); with Python's defaults the collector took 20% of an
    ``optimize`` call on the README's U-Net and 9% on a 4-layer Llama in a fresh process, 5% and
    3% with these (one CPU thread, 2026-12-04). Garbage is still collected, only later. For a
    process fxopt owns: the console script, and the test suite's processes."""
    gc.set_threshold(*THRESHOLDS)


def main(argv: list[str] | None = None) -> int:
    """The ``fxopt`` console script and ``python -m fxopt``: ``fxopt.cli.commands.main`` in a
    process of its own, which it sets to ``collect_garbage_less_often`` before the imports: the
    README's main job took 6.7-6.9 s instead of 7.0-7.8 s (alternated, 2026-12-04). To run a
    command inside your own process, call ``fxopt.cli.commands.main``, which leaves the
    collector as it is."""
    collect_garbage_less_often()
    from fxopt.cli.commands import main as run

    return run(argv)


__all__ = ["THRESHOLDS", "collect_garbage_less_often", "main"]
