"""torch's own capture logging, held back unless asked for.

A failed ``torch.export`` logs a lot before fxopt can say anything: ``Unable to find user code
corresponding to {u0}`` warnings and whole graph dumps (over a hundred lines for a small CNN),
through the ``torch.*`` loggers and, for the partial graph of a failed export, a bare
``print(..., file=sys.stderr)`` in ``torch.export``; plus the odd Python warning.
``torch_logs_held()`` collects all of these instead of letting them print. Afterwards they are
dropped, unless ``FXOPT_VERBOSE=1`` is set in the environment: then they are printed to stderr
when the capture succeeds, and attached to an fxopt error that passes through as a note (Python
prints notes after the error's own message, and so does the CLI: fxopt's error comes first).

When it is safe: inside, the ``torch`` logger tree's handlers are replaced (and restored on
exit), Python warnings are recorded and ``sys.stderr`` is redirected; the user's own loggers and
handlers are untouched (what the model itself writes to stderr while being captured is held
too). Not handled: output written to the process's file descriptor 2 below Python (C++ warnings
printed by torch's kernels).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator

from fxopt.core.errors import FxoptError

VERBOSE_VARIABLE = "FXOPT_VERBOSE"


def verbose() -> bool:
    """Whether the user asked to see torch's own logging (``FXOPT_VERBOSE=1``)."""
    return os.environ.get(VERBOSE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"[{record.name}] {record.levelname}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 -- a record that cannot format is dropped
            pass


def _torch_loggers() -> list[logging.Logger]:
    names = ["torch", *(name for name in logging.root.manager.loggerDict
                        if name.startswith("torch."))]
    found = [logging.getLogger(name) for name in names]
    return [logger for logger in found if logger.handlers or logger.name == "torch"]


@contextlib.contextmanager
def torch_logs_held() -> Iterator[list[str]]:
    """Inside: torch's log records and Python warnings are collected (yielded, one line each)
    instead of printed; see the module doc for what happens to them afterwards."""
    held = _Held()
    loggers = _torch_loggers()
    saved = [(logger, logger.handlers[:], logger.propagate) for logger in loggers]
    try:
        for logger in loggers:
            logger.handlers = [held]
            logger.propagate = False
        printed = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stderr(printed):
            warnings.simplefilter("always")
            try:
                yield held.lines
            except FxoptError as error:
                _add_held(held.lines, caught, printed)
                if verbose() and held.lines:
                    error.add_note("torch's own log while capturing (FXOPT_VERBOSE=1):\n"
                                   + "\n".join(held.lines))
                raise
        _add_held(held.lines, caught, printed)
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers = handlers
            logger.propagate = propagate
    if verbose() and held.lines:
        print("\n".join(held.lines), file=sys.stderr)


def _add_held(lines: list[str], caught: list[warnings.WarningMessage], printed: io.StringIO
              ) -> None:
    lines.extend(f"[warning] {w.category.__name__}: {w.message}" for w in caught)
    if printed.getvalue().strip():
        lines.append(f"[stderr]\n{printed.getvalue().rstrip()}")
