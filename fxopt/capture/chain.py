"""Which frontend captures a model: ``capture(model, args, capture="auto")``.

fxopt has two capture frontends, both returning a GraphModule that owns the user's Parameters:

- ``"fx"``: symbolic tracing (``fxopt.capture.trace``). Keeps module calls (``call_module``
  nodes), which the passes were written for, and keeps a submodule it cannot follow as an
  opaque leaf that no pass can look into. Fails only when the root's own ``forward`` cannot
  be traced.
- ``"export"``: ``torch.export`` (``fxopt.capture.export_frontend``). Follows Python that reads
  sizes (``torch.tril(torch.ones(T, T))`` with ``T`` from ``x.shape``) and decorated forwards,
  down to ATen operators; the module it returns serves the sizes the model's code leaves free
  (``dynamic=False``: the example's only) and refuses other inputs before computing. It refuses
  hooks and ``torch.utils.checkpoint`` calls. It keeps ``leaf_modules``, and a submodule it fails
  in on data-dependent code (an eager mixture-of-experts loop), as opaque module calls
  (``fxopt.capture.export_leaves``).

``"auto"`` (the default) takes symbolic tracing when it captures the whole model with no
opaque leaf, so such models (torchvision's among them) get exactly what ``trace`` gives.
Otherwise it tries torch.export, and when that fails too it returns the traced module with its
leaves, or, when symbolic tracing failed outright, a ``TraceError`` carrying both reasons.
torch.export is not tried when symbolic tracing captured the root around the user's
``leaf_modules``, nor when a submodule is in another training mode than the root (a frozen
BatchNorm: the exported graphs have every module in one mode); it keeps a submodule it cannot
follow opaque only when symbolic tracing failed at the root (else the traced graph, with its
leaves, is the better one). torch's own logging while
exporting (graph dumps of a failed export) is held back unless ``FXOPT_VERBOSE=1``
(``fxopt.capture.torch_logs``).

The result's ``meta["fxopt_trace"]`` (a ``TraceInfo``) says which frontend captured it
(``frontend``) and why each other one did not (``not_used``: one line per frontend).

Safe for any model ``trace`` or ``capture_with_export`` accepts; the user's model is never
modified. Costs: for a model with opaque leaves "auto" runs symbolic tracing and then
torch.export (twice: train and eval mode), so capture takes longer than before.
"""

from __future__ import annotations

import time
from typing import Any

from torch import fx, nn

from fxopt.capture.export_frontend import capture_with_export
from fxopt.capture.torch_logs import torch_logs_held
from fxopt.capture.trace import TraceInfo, trace
from fxopt.capture.trace_checks import UserCheckpoint
from fxopt.core import meta_keys
from fxopt.core.errors import ConfigError, FxoptError, TraceError
from fxopt.core.inputs import check_inputs

CAPTURE_CHOICES = ("auto", "fx", "export")


def check_capture_option(capture: Any, leaf_modules: tuple[str, ...] = (),
                         dynamic: Any = True) -> None:
    """``ConfigError`` unless ``capture`` is one of ``CAPTURE_CHOICES`` (every frontend keeps
    ``leaf_modules`` opaque) and ``dynamic`` a bool."""
    if capture not in CAPTURE_CHOICES:
        raise ConfigError(f"capture={capture!r} is not a capture frontend",
                          where="capture option",
                          hint=f"use one of: {', '.join(CAPTURE_CHOICES)} (default auto)")
    if not isinstance(dynamic, bool):
        raise ConfigError(f"dynamic={dynamic!r} is not a bool", where="capture option",
                          hint="dynamic=True (default: sizes torch.export may leave free stay "
                               "free) or dynamic=False (the example's sizes only)")


def capture(model: nn.Module, args: Any, *, capture: str = "auto",
            leaf_modules: tuple[str, ...] = (), example_kwargs: dict[str, Any] | None = None,
            dynamic: bool = True) -> fx.GraphModule:
    """``model`` as a GraphModule, captured by the frontend ``capture`` names ("auto", "fx" or
    "export"; see the module docstring); ``args`` are forward's positional arguments,
    ``example_kwargs`` its keyword ones (bound to their places by ``check_inputs``).
    ``dynamic=False``: torch.export records the example's sizes, which the captured module then
    requires (``fxopt.capture.export_frontend``); symbolic tracing records no sizes either way.

    Raises ``ConfigError`` for an unknown ``capture``, ``InputError`` for unusable inputs and
    ``TraceError`` when no frontend allowed captures the model.
    """
    check_capture_option(capture, leaf_modules, dynamic)
    args = check_inputs(model, args, example_kwargs)
    start = time.perf_counter()
    if capture == "fx":
        gm = trace(model, args, leaf_modules=leaf_modules)
        not_used = (("export", "capture='fx' was asked for"),)
    elif capture == "export":
        with torch_logs_held():
            gm = capture_with_export(model, args, leaf_modules=leaf_modules, dynamic=dynamic)
        not_used = (("fx", "capture='export' was asked for"),)
    else:
        gm, not_used = _auto(model, args, leaf_modules, dynamic)
    info: TraceInfo = gm.meta[meta_keys.TRACE]
    info.not_used = not_used
    info.seconds = time.perf_counter() - start
    return gm


def _auto(model: nn.Module, args: tuple, leaf_modules: tuple[str, ...], dynamic: bool
          ) -> tuple[fx.GraphModule, tuple[tuple[str, str], ...]]:
    traced: fx.GraphModule | None = None
    fx_error: TraceError | None = None
    try:
        traced = trace(model, args, leaf_modules=leaf_modules)
    except TraceError as error:  # an InputError is the inputs' fault: no frontend would help
        fx_error = error
    if traced is not None and not traced.meta[meta_keys.TRACE].leaves:
        return traced, (("export", "symbolic tracing captured the whole model"),)
    why_not_fx = (_first_line(fx_error) if fx_error is not None
                  else _leaves_line(traced.meta[meta_keys.TRACE]))
    # leaves the user named go to symbolic tracing when it captured the root
    why_not_export = _export_blocker(model, leaf_modules if traced is not None else ())
    export_error: FxoptError | None = None
    if why_not_export is None:
        try:
            with torch_logs_held():  # a failed export logs graph dumps: held back
                # Submodules export cannot follow are kept opaque only when symbolic tracing
                # failed at the root: else its module-level graph with the same leaves wins.
                exported = capture_with_export(model, args, leaf_modules=leaf_modules,
                                               opaque_on_failure=traced is None,
                                               dynamic=dynamic)
        except FxoptError as error:
            why_not_export, export_error = _first_line(error), error
        except Exception as error:  # a bug in the export frontend must not lose a working trace
            why_not_export = f"internal error: {type(error).__name__}: {_first(str(error))}"
        else:
            return exported, (("fx", why_not_fx),)
    if traced is not None:
        return traced, (("export", why_not_export),)
    # Both failed at the root: torch.export's reason comes first, as it ran forward as Python and
    # names the line that stopped it (symbolic tracing may fail earlier, on a decorated forward's
    # signature, which no change to the model's code would fix), unless tracing stopped at a
    # torch.utils.checkpoint call, whose own hint (move it into a submodule) is the fix.
    if export_error is not None and not isinstance(fx_error.__cause__, UserCheckpoint):
        both = TraceError(f"{export_error.what}\n(symbolic tracing cannot capture it either: "
                          f"{_first_line(fx_error)})", where=export_error.where,
                          hint=_not_back_to_fx(export_error.hint))
        for note in getattr(export_error, "__notes__", ()):  # torch's log, with FXOPT_VERBOSE=1
            both.add_note(note)
        raise both from export_error
    raise TraceError(f"{fx_error.what}\ntorch.export cannot capture it either: {why_not_export}",
                     where=fx_error.where, hint=fx_error.hint) from fx_error


_TO_FX = ("with capture='fx'", "use fxopt.trace(")  # a hint that recommends symbolic tracing


def _not_back_to_fx(hint: str | None) -> str:
    """torch.export's hint, unless it sends the user to symbolic tracing, which has just failed
    at the root: then what helps with either frontend (issue 25: hints never circular)."""
    if hint and not any(marker in hint for marker in _TO_FX):
        return hint
    return ("symbolic tracing cannot follow the root's forward, so torch.export must capture it: "
            "torch.export.draft_export(model, args, kwargs) lists every problem it meets; a "
            "submodule that stops it can be kept opaque with leaf_modules=('path',)")


def _export_blocker(model: nn.Module, leaf_modules: tuple[str, ...]) -> str | None:
    """Why "auto" must not try torch.export on ``model``, or None."""
    if leaf_modules:
        return ("leaf_modules names modules to keep opaque, and symbolic tracing captured the "
                "rest around them")
    mixed = next((path for path, m in model.named_modules() if m.training != model.training),
                 None)
    if mixed is not None:
        return (f"{mixed} is in {'train' if not model.training else 'eval'} mode, "
                f"the model in {'train' if model.training else 'eval'} mode; torch.export "
                "captures every module in one mode")
    return None


def _leaves_line(info: TraceInfo) -> str:
    paths = ", ".join(f"{leaf.path} ({leaf.module_type})" for leaf in info.leaves[:3])
    more = f" and {len(info.leaves) - 3} more" if len(info.leaves) > 3 else ""
    return f"kept {len(info.leaves)} submodule(s) as opaque leaves: {paths}{more}"


def _first_line(error: FxoptError) -> str:
    return _first(error.what)


def _first(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."
