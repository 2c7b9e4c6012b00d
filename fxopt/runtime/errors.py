"""Every error a user can hit from fxopt.

Each error says *what* happened, *where* (module path, node, source line) and *what to do*.
The CLI prints ``str(error)`` as one block and hides the traceback unless ``--debug``.

They live in the runtime, the lowest layer, so that what an optimized module runs (the input
guard, the fused optimizer step) raises them itself; every other layer imports them from
``fxopt.core.errors``, which re-exports them. Imports nothing (an exported folder gets a copy of
this file next to the runtime files that raise these errors).
"""

from __future__ import annotations


class FxoptError(Exception):
    """Base class of all fxopt errors: ``what`` happened, ``where``, and a ``hint``."""

    def __init__(self, what: str, *, where: str | None = None, hint: str | None = None):
        self.what = what
        self.where = where
        self.hint = hint
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [self.what]
        if self.where:
            lines.append(f"  where: {self.where}")
        if self.hint:
            lines.append(f"  what to do: {self.hint}")
        return "\n".join(lines)


class InputError(FxoptError):
    """The model or the example inputs are not something fxopt can work with."""


class TraceError(FxoptError):
    """torch.fx could not capture the model, even with leaf-module fallback."""


class ConfigError(FxoptError):
    """A pass list, pass option or budget is malformed or out of order."""


class PassError(FxoptError):
    """A pass crashed or left a graph that fails lint; names the pass and the passes before it."""


class EquivalenceError(FxoptError):
    """The optimized model does not compute the same function as the original."""


class BudgetError(FxoptError):
    """A memory budget cannot be met; the message says the smallest achievable peak, and
    ``smallest_bytes`` holds it where the planner knows it (else None)."""

    def __init__(self, what: str, *, where: str | None = None, hint: str | None = None,
                 smallest_bytes: int | None = None):
        self.smallest_bytes = smallest_bytes
        super().__init__(what, where=where, hint=hint)


class ExportError(FxoptError):
    """The optimized module cannot be written as a standalone Python module."""
