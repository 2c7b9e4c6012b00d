"""Progress of long work, as it happens: phases and their times.

``with phase("capture"): ...`` marks one phase of fxopt's work (capture, predict, each pass,
verify, measure). Phases nest (``optimize LlamaForCausalLM › passes › checkpoint``), and each one
is told two ways:

- **Python logging**, always: the logger ``"fxopt"`` gets an INFO record when a phase starts
  (``capture ...``) and when it ends (``capture: 3.1 s``). Nothing is printed unless the program
  configures logging (``logging.basicConfig(level=logging.INFO)``), as for any library.
- **A status line on stderr**, when it is a terminal: the phases running now and the seconds
  spent in the innermost one, redrawn in place twice a second and erased when the outermost phase
  ends. In a pipe or a file, nothing, unless asked: ``FXOPT_PROGRESS=1`` (or the CLI's
  ``--progress``) writes plain lines instead, one when a phase starts and one when it ends;
  ``FXOPT_PROGRESS=0`` silences the terminal line too.

``counter(title, done, total, label)`` shows a count of larger steps in front of the phases
(``fxopt bench [3/9] zoo:resnet18 fxopt``): the CLI's bars (``fxopt.cli.progress``) draw
through it, so one line shows both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

logger = logging.getLogger("fxopt")

ENVIRONMENT = "FXOPT_PROGRESS"


def _wanted(stream: TextIO) -> str | None:
    """How to show progress on ``stream``: "line" (a terminal's redrawn line), "plain" (a line
    per phase end, when asked in a pipe), or None."""
    setting = os.environ.get(ENVIRONMENT, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return None
    isatty = getattr(stream, "isatty", None)
    terminal = bool(isatty and isatty())
    if terminal:
        return "line"
    return "plain" if setting in ("1", "true", "yes", "on") else None


class _Status:
    """The one status line of this process (phases are per process, as the terminal is)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stack: list[tuple[str, float]] = []
        self.count = ""
        self.mode: str | None = None
        self.stream: TextIO | None = None
        self.forced: bool | None = None
        self.drawn = False
        self.ticker: threading.Thread | None = None

    # --- what happens -------------------------------------------------------------------------

    def begin(self, label: str) -> None:
        with self.lock:
            if not self.stack:  # the outermost phase decides where and how to show it
                self.stream = sys.stderr
                self.mode = self._mode()
            self.stack.append((label, time.perf_counter()))
            if self.mode == "plain":
                self._write(f"fxopt: {' › '.join(name for name, _ in self.stack)} ...\n")
            self._draw()
            if self.mode == "line" and self.ticker is None:
                self.ticker = threading.Thread(target=self._tick, name="fxopt-progress",
                                               daemon=True)
                self.ticker.start()

    def end(self, label: str, seconds: float, failed: bool) -> None:
        with self.lock:
            path = " › ".join(name for name, _ in self.stack)
            if self.stack:
                self.stack.pop()
            if self.mode == "plain":
                self._write(f"fxopt: {path}: {seconds:.1f} s{' (failed)' if failed else ''}\n")
            if self.stack:
                self._draw()
            else:
                self._erase()
                self.mode, self.count = None, ""

    def set_count(self, text: str) -> None:
        with self.lock:
            self.count = text
            self._draw()

    # --- drawing ------------------------------------------------------------------------------

    def _mode(self) -> str | None:
        if self.forced is False:
            return None
        wanted = _wanted(self.stream)
        if self.forced and wanted is None:
            return "plain"
        return wanted

    def _draw(self) -> None:
        if self.mode != "line" or not self.stack:
            return
        label, started = self.stack[-1]
        path = " › ".join(name for name, _ in self.stack)
        count = self.count + " " if self.count else ""
        line = f"fxopt {count}{path}  {time.perf_counter() - started:.0f} s"
        self._write("\r" + line[:150] + "\x1b[K")
        self.drawn = True

    def _erase(self) -> None:
        if self.drawn:
            self._write("\r\x1b[K")
            self.drawn = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed or odd stream: show nothing
            self.mode = None

    def _tick(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                if self.mode != "line" or not self.stack:
                    self.ticker = None
                    return
                self._draw()


_STATUS = _Status()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """One phase of work: logged at its start and end (with its seconds), and shown on the
    status line while it runs."""
    logger.info("%s ...", name)
    _STATUS.begin(name)
    started = time.perf_counter()
    failed = True
    try:
        yield
        failed = False
    finally:
        seconds = time.perf_counter() - started
        _STATUS.end(name, seconds, failed)
        logger.info("%s: %.1f s%s", name, seconds, " (stopped by an error)" if failed else "")


def counter(title: str, done: int, total: int, label: str = "") -> None:
    """Show ``[done/total] label`` of a larger job in front of the phases."""
    text = f"{title} [{done}/{total}]{' ' + label if label else ''}".strip()
    _STATUS.set_count(text if done < total else "")
    logger.info("%s", text)


@contextlib.contextmanager
def shown(enabled: bool | None) -> Iterator[None]:
    """Inside: progress shown (True, even in a pipe: plain lines), not shown (False), or as the
    stream and ``FXOPT_PROGRESS`` decide (None)."""
    before = _STATUS.forced
    _STATUS.forced = enabled
    try:
        yield
    finally:
        _STATUS.forced = before
