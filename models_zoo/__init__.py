"""Named reference models with example inputs for fxopt's tests, benchmarks and CLI (``zoo:NAME``).

Every model is randomly initialised (no downloads) and deterministic: ``get(name).build()`` gives
identical weights on every call without touching torch's global RNG state, and
``example_inputs(batch_size)`` gives identical tensors for the same batch size.
"""

from fxopt.models_zoo.entry import ZooEntry
from fxopt.models_zoo.registry import build, get, names, selected

__all__ = ["ZooEntry", "build", "get", "names", "selected"]
