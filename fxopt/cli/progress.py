"""A progress bar for long CLI work: drawn on a terminal, silent when the output is piped.

``Progress`` is the ``progress(done, total, label)`` callable that ``fxopt.bench.bench`` and
``fxopt.check.check_equivalence`` accept. It writes to stderr (so ``--json`` on stdout stays
clean), redraws one line with ``\\r``, and ends the line when ``done == total``. Whether it
draws is decided once: ``enabled=None`` means "if the stream is a terminal".
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, title: str = "", *, stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 24):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.title = title
        self.width = width
        self._drawn = False

    def __call__(self, done: int, total: int, label: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * done // total if total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.title + ' ' if self.title else ''}[{bar}] {done}/{total} {label}"
        self.stream.write("\r" + line[:120] + "\x1b[K")  # erase what a longer line left
        self._drawn = done < total
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()

    def close(self) -> None:
        """End a bar that did not reach its total (an error stopped the work)."""
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
