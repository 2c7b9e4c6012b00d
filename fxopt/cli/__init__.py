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


def main(argv: list[str] | None = None) -> int:
    """The ``fxopt`` console script and ``python -m fxopt``: ``fxopt.cli.commands.main`` in a
    process of its own, whose garbage collector it sets for a run of torch and fxopt: the young
    generation collected every 10,000 allocations instead of 700 and a full collection after
    100 of the middle generation's instead of 10. A full collection scans every object the
    process holds (torch's are millions); with Python's defaults the collector took 20% of an
    ``optimize`` call on the README's U-Net and 9% on a 4-layer Llama in a fresh process, 5% and
    3% with these, and the README's main job 6.7-6.9 s instead of 7.0-7.8 s (one CPU thread,
    alternated, 2026-12-04). To run a command inside your own process, call
    ``fxopt.cli.commands.main``, which leaves the collector as it is."""
    gc.set_threshold(10_000, 10, 100)
    from fxopt.cli.commands import main as run

    return run(argv)


__all__ = ["main"]
