"""Every error a user can hit from fxopt: ``fxopt.FxoptError`` and its subclasses.

Each error says *what* happened, *where* (module path, node, source line) and *what to do*.
The CLI prints ``str(error)`` as one block and hides the traceback unless ``--debug``.

The classes are defined in ``fxopt.runtime.errors`` (what an optimized module runs raises them
too, and the runtime imports torch and the standard library only); this module is where the
rest of fxopt, and users, import them from.
"""

from __future__ import annotations

from fxopt.runtime.errors import (
    BudgetError,
    ConfigError,
    EquivalenceError,
    ExportError,
    FxoptError,
    InputError,
    PassError,
    TraceError,
)

__all__ = ["BudgetError", "ConfigError", "EquivalenceError", "ExportError", "FxoptError",
           "InputError", "PassError", "TraceError"]
