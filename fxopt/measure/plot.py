"""Draw memory timelines (``fxopt.measure.timeline``) to a PNG with matplotlib, imported only here.

matplotlib is the optional extra ``plot`` (``pip install 'fxopt[plot]'``); without it
``plot_timelines`` raises ``ConfigError`` saying how to install it, and ``missing_matplotlib``
says so beforehand (``fxopt report`` then prints its report without the plot). The figure is
drawn with matplotlib's object API on an Agg canvas, so no GUI backend is needed and the global
pyplot state of a user's session is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fxopt.core.errors import ConfigError
from fxopt.measure.timeline import Timeline

_MIB = 2**20
INSTALL_HINT = "install the plot extra: pip install 'fxopt[plot]' (or pip install matplotlib)"


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError(f"cannot draw the memory plot: matplotlib is not installed ({error})",
                          hint=INSTALL_HINT) from error
    return Figure, FigureCanvasAgg


def missing_matplotlib() -> str | None:
    """None when the plot can be drawn; else one line saying that matplotlib is missing and how to
    get it."""
    try:
        _matplotlib()
    except ConfigError:
        return f"no plot: matplotlib is not installed; {INSTALL_HINT}"
    return None


def plot_timelines(timelines: Sequence[Timeline], path: str | Path, *, title: str = "") -> Path:
    """Live memory over the ops of a training step, one curve per timeline; returns ``path``."""
    Figure, FigureCanvasAgg = _matplotlib()
    figure = Figure(figsize=(10, 4.5), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for index, timeline in enumerate(timelines):
        color = f"C{index}"
        axes.plot(range(len(timeline.live_bytes)), [b / _MIB for b in timeline.live_bytes],
                  color=color, linewidth=1.2,
                  label=f"{timeline.label}: peak {timeline.peak_bytes / _MIB:.1f} MiB "
                        f"at {timeline.peak_op}")
        axes.axvline(timeline.backward_start, color=color, linestyle="--", linewidth=0.8)
        axes.plot([timeline.peak_index], [timeline.peak_bytes / _MIB], "o", color=color)
    if timelines:
        axes.axhline(timelines[0].baseline_bytes / _MIB, color="gray", linestyle=":",
                     linewidth=0.8, label="parameters + buffers + inputs")
    axes.set_xlabel("op of one training step (dashed: backward starts)")
    axes.set_ylabel("live tensor memory (MiB)")
    axes.set_title(title or "memory over a training step")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
