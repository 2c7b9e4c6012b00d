"""The ``fxopt`` command line: argparse -> API -> printed table.

- ``commands``: subcommands optimize, check, report, bench.
- ``targets``: TARGET strings (``zoo:NAME``, ``eco:NAME``, ``file.py:Name``,
  ``package.module:factory``) to a model and its example inputs.
- ``inputs``: example inputs described by flags (``--input``, ``--input-shape``, ``--int-range``).
- ``device``: ``--device`` (checked, model and inputs moved) and ``--threads``.
- ``progress``: a progress bar drawn only on a terminal.
"""

from fxopt.cli.commands import main

__all__ = ["main"]
