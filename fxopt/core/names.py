"""The name a Python object can be imported back under: ``qualified_name``.

The export writer references functions and classes in generated code by it; the prediction
memo describes a function or class by it (``fxopt.analysis.prediction_memo``), and by its
address when there is none.
"""

from __future__ import annotations

import importlib
from typing import Any


def qualified_name(obj: Any) -> tuple[str, str] | None:
    """(module, qualname) under which ``obj`` can be imported back, or None (a closure, a lambda,
    a class made at run time, anything defined in ``__main__``)."""
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    candidates = [(module_name, qualname)] if module_name and qualname else []
    name = getattr(obj, "__name__", None)
    if name:  # builtins of torch's C extension often have no usable __module__
        candidates += [("torch", name), ("torch.nn.functional", name)]
    for module_name, qualname in candidates:
        if module_name == "__main__" or "<locals>" in qualname:
            continue
        try:
            target: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError):
            continue
        if target is obj:
            return module_name, qualname
    return None
