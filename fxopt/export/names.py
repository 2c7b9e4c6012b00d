"""How the generated module names what it uses: imports, and copies of fxopt's torch-only runtime.

``Imports.reference(obj)`` gives an expression for a function or class in the generated source
and records the import it needs: from torch; from the module that defines it (a user's own
function or leaf class: that module must then be importable where the export is loaded, and is
listed in ``needs``); or, for fxopt's own modules that import nothing but torch and the standard
library (``fxopt.runtime.regions``), from a copy of that module written next to the generated one.
A runtime module may import its siblings relatively (``from .errors import InputError``): they
are copied too, and the copy's import names the sibling's copy (the generated module loads the
copies as modules of one package made for the folder, so relative imports resolve there).
Anything else -- objects defined inside a function or in ``__main__``, fxopt modules that need
more than torch -- is an ``ExportError``.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import sys
from typing import Any

from fxopt.core.names import qualified_name

from torch import fx

from fxopt.core.errors import ExportError

_OWN_DISTRIBUTION = ("fxopt", "passes", "models_zoo")
# fx's generated code uses these without an import of its own; the generated header has them,
# but for fx's pytree helpers (torch's private pytree modules), which a graph may not use.
FX_BUILTINS = frozenset({"inf", "nan", "NoneType", "torch", "device", "fx_pytree", "pytree"})
_PYTREE_USE = re.compile(r"\b(?:fx_)?pytree\.")


def torch_only_siblings(source: str) -> list[str] | None:
    """The sibling modules a module imports relatively (``from .errors import ...`` gives
    ``errors``) when its top-level imports are otherwise all torch, the standard library or
    __future__; None when it imports anything else."""
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    siblings = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                siblings.append(node.module)
                continue
            if node.level:
                return None
            names = [node.module or ""]
        else:
            continue
        if any(name.split(".")[0] not in allowed for name in names):
            return None
    return siblings


def runtime_filename(module_name: str) -> str:
    """The file a copy of the fxopt module ``module_name`` is written to in an exported folder."""
    return f"_runtime_{module_name.replace('.', '_')}.py"


def _copied_source(source: str, package: str) -> str:
    """``source`` with each relative import of a sibling naming the sibling's copy."""
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            line = lines[node.lineno - 1]
            stem = runtime_filename(f"{package}.{node.module}")[:-len(".py")]
            lines[node.lineno - 1] = line.replace(f"from .{node.module} import",
                                                  f"from .{stem} import", 1)
    return "".join(lines)


class Imports:
    """The import lines, runtime copies and outside modules a generated module needs."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.runtime_files: dict[str, str] = {}       # file name -> source text
        self.needs: list[str] = []                     # modules besides torch, in first-use order
        self.fx_globals: dict[str, str] = {}           # a name fx's code uses -> its expression
        self._modules: dict[str, str] = {}             # module name -> alias

    def reference(self, obj: Any, where: str) -> str:
        """An expression naming the function or class ``obj`` in the generated module."""
        found = qualified_name(obj)
        if found is None:
            raise ExportError(
                f"cannot export: {where} is {obj!r}, which cannot be imported by name",
                where=where,
                hint="define it at module level in an importable module (not inside a function "
                     "or in __main__)")
        module_name, qualname = found
        return f"{self.module(module_name, where)}.{qualname}"

    def module(self, module_name: str, where: str) -> str:
        """An alias of the imported module ``module_name``."""
        if module_name in self._modules:
            return self._modules[module_name]
        alias = f"_import_{len(self._modules)}"
        root = module_name.split(".")[0]
        if root in _OWN_DISTRIBUTION:
            self._copy(module_name, where)
            self.lines.append(f"{alias} = _runtime({runtime_filename(module_name)!r})")
        else:
            if root != "torch" and module_name not in self.needs:
                self.needs.append(module_name)
            self.lines.append(f"import {module_name} as {alias}")
        self._modules[module_name] = alias
        return alias

    def _copy(self, module_name: str, where: str) -> None:
        """Copy ``module_name`` and the siblings it imports relatively into the folder's files;
        an ``ExportError`` when one needs more than torch."""
        filename = runtime_filename(module_name)
        if filename in self.runtime_files:
            return
        source = inspect.getsource(importlib.import_module(module_name))
        siblings = torch_only_siblings(source)
        if siblings is None:
            raise ExportError(
                f"cannot export standalone: {where} uses {module_name}, which needs more "
                "than torch", where=where,
                hint="leave out the pass that introduced it, or keep fxopt installed and use "
                     "the optimized module from Python")
        package = module_name.rpartition(".")[0]
        self.runtime_files[filename] = _copied_source(source, package)
        for sibling in siblings:
            self._copy(f"{package}.{sibling}", f"{where}, through {module_name}")

    def forward_source(self, graph: fx.Graph, where: str, name: str = "forward") -> str:
        """``def <name>(self, ...)`` from torch.fx's code generation, indented for a class; the
        globals it uses become module-level names of the generated module."""
        code = graph.python_code(root_module="self")
        if _PYTREE_USE.search(code.src):
            raise ExportError(f"cannot export: {where} flattens its arguments with torch's "
                              "private pytree modules (a graph with a pytree calling convention)",
                              where=where, hint="report this model to fxopt")
        code.src = code.src.replace("def forward(", f"def {name}(", 1)
        # the torch.fx.wrap lines of fxopt's calls (``wrap_own_calls``) serve torch.fx's re-trace
        # of a pickled module; a written module is never re-traced, and its class body cannot
        # call wrap
        wrap = f"{fx.wrap.__module__}.{fx.wrap.__name__}("
        code.src = "\n".join(line for line in code.src.splitlines()
                              if not line.startswith(wrap))
        for name, obj in code.globals.items():
            if name in FX_BUILTINS or getattr(builtins, name, None) is obj:
                continue
            expr = self._global(obj, f"{where}: global {name}")
            if self.fx_globals.setdefault(name, expr) != expr:
                raise ExportError(f"cannot export: two graphs use the name {name!r} for different "
                                  "objects", where=where, hint="report this as an fxopt bug")
        lines = code.src.strip("\n").splitlines()
        return "\n".join("    " + line if line.strip() else "" for line in lines)

    def _global(self, obj: Any, where: str) -> str:
        """A function or class, a string annotation, or a typing form (``typing.Optional``)."""
        if obj is None or isinstance(obj, (str, int, float, bool)):
            return repr(obj)
        typing_name = getattr(obj, "_name", None)
        if getattr(obj, "__module__", None) == "typing" and typing_name and \
                qualified_name(obj) is None:
            return f"{self.module('typing', where)}.{typing_name}"
        return self.reference(obj, where)
