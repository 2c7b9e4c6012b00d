"""The ``fxopt`` command line: argparse -> API -> printed table.

- ``commands``: subcommands optimize, check, report, bench.
- ``targets``: TARGET strings (``zoo:NAME``, ``file.py:Name``, ``package.module:factory``).
- ``progress``: a progress bar drawn only on a terminal.
"""

from fxopt.cli.commands import main

__all__ = ["main"]
