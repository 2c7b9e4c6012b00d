"""fxopt: rewrite PyTorch models with torch.fx to use less memory, and prove they are unchanged.

Public API only; see README.md for a walkthrough and its architecture section for the layers
(``core`` -> ``graph`` -> ``capture`` -> ``analysis`` -> ``planning`` -> ``rewrite`` -> ``verify`` /
``measure`` -> ``export`` / ``bench`` / ``cli``; ``runtime`` is what optimized modules call;
``integrations`` holds what other libraries' training loops need, Hugging Face's ``Trainer``).

``import fxopt`` is cheap: it imports neither torch nor fxopt's layers. The first public name
read (``fxopt.optimize``, ``from fxopt import measure``) imports them all, as an eager package
would, so ``fxopt --help`` answers without loading torch.

Two packages of the repository live beside ``fxopt/`` and are installed inside it:
``passes/`` is ``fxopt.passes`` and ``models_zoo/`` is ``fxopt.models_zoo`` (pyproject's
``package-dir``), so an installed fxopt adds no top-level ``passes`` to a user's site-packages.
Run from a source tree (``PYTHONPATH=<repo>``, or an editable install), ``_SourceLayout`` finds
them beside ``fxopt/``.
"""

from __future__ import annotations

import importlib as _importlib
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
import types as _types
from pathlib import Path as _Path

__version__ = "0.1.0"  # pyproject.toml reads it from here (tool.setuptools.dynamic)

# Modules saved with torch.save before the layered packages (or before a module moved layer)
# name these modules (their pickles and generated code import e.g. fxopt.regions.call_region):
# keep them importable. fxopt.core.pretrained moved to fxopt.integrations.hf_trainer with Hugging
# Face's integration; five capture modules to the graph layer.
_FLAT_LAYOUT_NAMES = {
    "fxopt.regions": "fxopt.runtime.regions",
    "fxopt.trace": "fxopt.capture.trace",
    "fxopt.report": "fxopt.measure.report",
    "fxopt.pipeline": "fxopt.rewrite.pipeline",
    "fxopt.core.pretrained": "fxopt.integrations.hf_trainer",
    "fxopt.rewrite.shard_guard": "fxopt.integrations.fsdp",
    "fxopt.capture.fake_run": "fxopt.graph.fake_run",
    "fxopt.capture.meta": "fxopt.graph.meta",
    "fxopt.capture.train_eval": "fxopt.graph.train_eval",
    "fxopt.capture.leaf_tape": "fxopt.graph.leaf_tape",
    "fxopt.capture.leaf_runs": "fxopt.capture.leaf_recording",
}
# Packages kept beside fxopt/ in the repository, installed inside it (pyproject's package-dir).
_BESIDE = {"fxopt.passes": "passes", "fxopt.models_zoo": "models_zoo"}


class _AliasLoader(_abc.Loader):
    """Loads an old module name as the module that now holds its code (the same object)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):  # noqa: ANN001, ANN201
        module = _importlib.import_module(self.target)
        self.spec = module.__spec__  # the import system sets the alias's spec on it: undone below
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        module.__spec__ = self.spec


_HERE = _Path(__file__).resolve().parent


class _SourceLayout(_abc.MetaPathFinder):
    """Old flat names as aliases, and ``fxopt.passes`` / ``fxopt.models_zoo`` from the source
    tree this fxopt was imported from (``passes/`` beside ``fxopt/``, next to pyproject.toml).
    An installed fxopt holds them inside its own folder, and then this finder stays out of the
    way; a source tree's own folders win over another installation's (an editable install of
    another checkout), so a work tree always runs its own passes."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname in _FLAT_LAYOUT_NAMES:
            return _util.spec_from_loader(fullname, _AliasLoader(_FLAT_LAYOUT_NAMES[fullname]))
        folder = _BESIDE.get(fullname)
        if folder is None or (_HERE / fullname.split(".")[1]).is_dir():  # installed inside
            return None
        init = _HERE.parent / folder / "__init__.py"
        if not (init.is_file() and (_HERE.parent / "pyproject.toml").is_file()):
            return None
        return _util.spec_from_file_location(fullname, init,
                                             submodule_search_locations=[str(init.parent)])


if not any(type(f).__name__ == "_SourceLayout" for f in _sys.meta_path):
    _sys.meta_path.insert(0, _SourceLayout())

# Each public name and the module that defines it; imported on first use (module __getattr__).
_PUBLIC = {
    "estimate_peak": "fxopt.analysis", "max_batch_size": "fxopt.analysis",
    "optimize": "fxopt.api", "trace": "fxopt.capture.trace",
    "capture_model": "fxopt.capture.reuse",
    "pretrained_checkpoints": "fxopt.integrations.hf_trainer",
    "TrainingSetup": "fxopt.core.training_setup",
    **dict.fromkeys(["BudgetError", "ConfigError", "EquivalenceError", "ExportError", "FxoptError",
                     "InputError", "PassError", "TraceError"], "fxopt.core.errors"),
    **dict.fromkeys(["MemoryFigure", "MemoryReport", "measure", "measure_inference",
                     "measure_train_step"], "fxopt.measure"),
    "Report": "fxopt.measure.report", "blocks": "fxopt.rewrite.blocks",
    "release_inputs": "fxopt.rewrite.boxed", "PassResult": "fxopt.rewrite.pass_base",
    "Config": "fxopt.rewrite.pipeline", "fuse_optimizer": "fxopt.runtime.fuse",
    "FusedOptimizer": "fxopt.runtime.fused_step", "VerifyReport": "fxopt.verify",
    "verify": "fxopt.verify", "FusedTrainingReport": "fxopt.verify.fused_training",
    "verify_fused_training": "fxopt.verify.fused_training",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def _load() -> None:
    """Import the public API (and with it every layer), binding each public name here."""
    namespace = globals()
    for name, module in _PUBLIC.items():
        namespace[name] = getattr(_importlib.import_module(module), name)


class _Package(_types.ModuleType):
    """fxopt's module object: public names imported on first use, and a submodule never
    replaces the public function of its name (``fxopt.measure``, ``fxopt.verify``: packages and
    functions; ``fxopt.trace``: an old module name and a function), as in an eager package."""

    def __getattr__(self, name: str):  # noqa: ANN204
        if name.startswith("__"):
            raise AttributeError(name)
        _load()  # as an eager package would have: every layer imported on first use
        namespace = globals()
        if name in namespace:
            return namespace[name]
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'fxopt' has no attribute {name!r}") from None

    def __setattr__(self, name: str, value) -> None:  # noqa: ANN001
        if name in _PUBLIC and isinstance(value, _types.ModuleType):
            return  # the import system binding a submodule: the public function keeps the name
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(globals()) | set(_PUBLIC))


_sys.modules[__name__].__class__ = _Package
