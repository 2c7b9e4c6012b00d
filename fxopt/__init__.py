"""fxopt: rewrite PyTorch models with torch.fx to use less memory, and prove they are unchanged.

Public API only; see README.md for a walkthrough and its architecture section for the layers
(``core`` -> ``capture`` -> ``analysis`` -> ``planning`` -> ``rewrite`` -> ``verify`` /
``measure`` -> ``export`` / ``bench`` / ``cli``; ``runtime`` is what optimized modules call).
"""

import importlib as _importlib
import sys as _sys

from fxopt.analysis import estimate_peak, max_batch_size
from fxopt.api import optimize
from fxopt.capture.trace import trace
from fxopt.core.pretrained import pretrained_checkpoints
from fxopt.core.training_setup import TrainingSetup
from fxopt.core.errors import (
    BudgetError,
    ConfigError,
    EquivalenceError,
    ExportError,
    FxoptError,
    InputError,
    PassError,
    TraceError,
)
from fxopt.measure import (
    MemoryFigure,
    MemoryReport,
    measure,
    measure_inference,
    measure_train_step,
)
from fxopt.measure.report import Report
from fxopt.rewrite.blocks import blocks
from fxopt.rewrite.boxed import release_inputs
from fxopt.rewrite.pass_base import PassResult
from fxopt.rewrite.pipeline import Config
from fxopt.runtime.fuse import fuse_optimizer
from fxopt.runtime.fused_step import FusedOptimizer
from fxopt.verify import VerifyReport, verify
from fxopt.verify.fused_training import FusedTrainingReport, verify_fused_training

# Modules saved with torch.save before the layered packages (or before a module moved layer)
# name these modules (their pickles and generated code import e.g. fxopt.regions.call_region):
# keep them importable.
_FLAT_LAYOUT_NAMES = {
    "fxopt.regions": "fxopt.runtime.regions",
    "fxopt.trace": "fxopt.capture.trace",
    "fxopt.report": "fxopt.measure.report",
    "fxopt.pipeline": "fxopt.rewrite.pipeline",
    # moved to the graph layer (fxopt.graph) from fxopt.capture
    "fxopt.capture.fake_run": "fxopt.graph.fake_run",
    "fxopt.capture.meta": "fxopt.graph.meta",
    "fxopt.capture.train_eval": "fxopt.graph.train_eval",
    "fxopt.capture.leaf_tape": "fxopt.graph.leaf_tape",
    "fxopt.capture.leaf_runs": "fxopt.capture.leaf_recording",
}
for _old, _new in _FLAT_LAYOUT_NAMES.items():
    _sys.modules.setdefault(_old, _importlib.import_module(_new))

__all__ = [
    "BudgetError", "Config", "ConfigError", "EquivalenceError", "ExportError", "FxoptError",
    "InputError", "MemoryFigure", "MemoryReport", "PassError", "PassResult", "Report",
    "TraceError", "VerifyReport", "blocks", "estimate_peak", "max_batch_size", "measure",
    "measure_inference", "measure_train_step", "optimize", "release_inputs", "trace", "verify",
]
__all__ += ["pretrained_checkpoints", "TrainingSetup"]
__all__ += ["FusedOptimizer", "FusedTrainingReport", "fuse_optimizer", "verify_fused_training"]
