"""fxopt: rewrite PyTorch models with torch.fx to use less memory, and prove they are unchanged.

Public API only; see README.md for a walkthrough.
"""

from fxopt.analysis import estimate_peak, max_batch_size
from fxopt.api import optimize
from fxopt.boxed import release_inputs
from fxopt.errors import (
    BudgetError,
    ConfigError,
    EquivalenceError,
    FxoptError,
    InputError,
    PassError,
    TraceError,
)
# The exporter is fxopt.export.export (the name fxopt.export stays the module).
from fxopt.export_names import ExportError
from fxopt.measure import MemoryFigure, MemoryReport, measure, measure_inference, measure_train_step
from fxopt.pass_base import PassResult
from fxopt.pipeline import Config
from fxopt.report import Report
from fxopt.trace import trace
from fxopt.verify import VerifyReport, verify

__all__ = [
    "BudgetError", "Config", "ConfigError", "EquivalenceError", "ExportError", "FxoptError",
    "InputError", "MemoryFigure", "MemoryReport", "PassError", "PassResult", "Report",
    "TraceError", "VerifyReport", "estimate_peak", "max_batch_size", "measure",
    "measure_inference", "measure_train_step", "optimize", "release_inputs", "trace", "verify",
]
