"""Export an optimized module as a folder that loads with plain torch: ``export(gm, out_dir)``.

- ``writer``: ``export`` and ``load_exported``: write, re-import and verify the folder.
- ``codegen``: ``model.py`` from torch.fx's generated code.
- ``blocks``: the graph modules written as classes of their own (the blocks the root calls).
- ``module_tree``: the ``__init__`` that rebuilds the module tree.
- ``names``: imports of the generated module and copies of fxopt's torch-only runtime.
"""

from fxopt.core.errors import ExportError
from fxopt.export.writer import ExportBug, export, load_exported

__all__ = ["ExportBug", "ExportError", "export", "load_exported"]
