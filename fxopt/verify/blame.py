"""Whose change a failed verification is: the capture's or the passes'.

``optimize`` verifies the optimized module against the user's model. When that fails, the usual
suspect is a pass, and ``EquivalenceError``'s hint says how to bisect them. But capture itself
can change the function: torch.export follows the code path fake tensors take, so a module that
picks another path at run time (``nn.TransformerEncoder``'s nested-tensor fast path in eval mode
with a padding mask) computes something else once captured, and ``passes=[]`` fails the same way.
``capture_blamed(error, ...)`` tells the two apart: when no pass changed the graph, or when the
module as captured, before the passes, differs too, the error says that capture changed the
function, names the frontend, and points at what captures the model faithfully instead, never
at a frontend that already failed on it.

Cost: one more verification, only on the failure path, and only when a pass changed the graph
(``optimize`` keeps a structural copy of the captured module, which costs a graph copy).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fxopt.core.errors import EquivalenceError
from fxopt.verify.equivalence import verify

_FRONTEND_NAMES = {"fx": "symbolic tracing (capture='fx')",
                   "export": "torch.export (capture='export')"}


def _other_frontend_hint(frontend: str, not_used: dict[str, str]) -> str:
    """What to try instead of ``frontend``: the other frontend only when it was not tried and
    failed on this model."""
    other = "fx" if frontend == "export" else "export"
    why_not = not_used.get(other, "")
    tried_and_failed = (why_not and "was asked for" not in why_not
                        and "captured the whole" not in why_not)
    keep = ("keep the submodule whose code differs at run time opaque with "
            "leaf_modules=('path.to.module',) (fxopt then calls it as written)")
    if tried_and_failed:
        return f"{keep}; {_FRONTEND_NAMES[other]} cannot capture this model ({why_not})"
    return f"capture with capture={other!r}, or {keep}"


def capture_blamed(error: EquivalenceError, *, frontend: str, not_used: Any,
                   passes_changed: list[str], model: nn.Module, args: tuple,
                   unoptimized: nn.Module) -> EquivalenceError:
    """``error`` itself when the passes changed the function; else an ``EquivalenceError``
    saying that capture by ``frontend`` did (see the module doc). ``unoptimized``: the module
    as captured, before any pass (a structural copy ``optimize`` keeps: the passes' edits of
    the graph and of the module tree do not reach it)."""
    if passes_changed:
        try:
            report = verify(model, unoptimized, args)
        except Exception:  # noqa: BLE001 -- cannot tell: the passes' error stands
            return error
        if report.ok:
            return error
    reasons = dict(not_used or ())
    blamed = EquivalenceError(
        f"capture changed the function: the model as {_FRONTEND_NAMES.get(frontend, frontend)} "
        f"captured it, before any pass ran, already differs from the original (passes=[] gives "
        f"the same error), so no pass is to blame.\n{error.what}",
        where=f"capture by {frontend}; {error.where}",
        hint=_other_frontend_hint(frontend, reasons) + ". Modules that take another code path "
             "at run time than on fake tensors (nn.TransformerEncoder's nested-tensor fast path "
             "in eval mode with a padding mask) are the usual cause")
    blamed.report = getattr(error, "report", None)
    return blamed
