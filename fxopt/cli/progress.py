"""A progress bar for long CLI work: drawn on a terminal, silent when the output is piped.

``Progress`` is the ``progress(done, total, label)`` callable that ``fxopt.bench.bench`` and
``fxopt.check.check_equivalence`` accept. Made with neither ``stream`` nor ``enabled`` (as the
CLI makes it), it shows its count on fxopt's one status line (``fxopt.core.progress``), in front
of the phases running inside each step (capture, each pass, verify), so that one line on stderr
tells both; ``--progress`` / ``FXOPT_PROGRESS=1`` show them in a pipe too. Given a stream, it
draws its own bar there: it redraws one line with ``\\r`` and ends the line when
``done == total``; ``enabled=None`` then means "if the stream is a terminal".
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, title: str = "", *, stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 24):
        self.shared = stream is None and enabled is None  # through fxopt's status line
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.title = title
        self.width = width
        self._drawn = False

    def __call__(self, done: int, total: int, label: str = "") -> None:
        if self.shared:
            from fxopt.core.progress import counter
            counter(self.title, done, total, label)
            return
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
        if self.shared:
            from fxopt.core.progress import counter
            counter(self.title, 1, 1)
            return
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
