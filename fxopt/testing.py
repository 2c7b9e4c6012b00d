"""A one-line equivalence check for a user's own test suite.

::

    from fxopt.testing import assert_equivalent

    def test_optimized_model_is_equivalent():
        fast = assert_equivalent(MyNet(), torch.randn(8, 3, 64, 64), memory_budget=0.5,
                                 batch_sizes=(1, 8))

``assert_equivalent`` optimizes the model (the pipeline of ``fxopt.optimize`` with the same
options) and verifies it on the example inputs and on random inputs per seed and batch size
(``fxopt.check.check_equivalence``: outputs, input and parameter gradients, buffers after a
training step, eval outputs). It raises ``AssertionError`` naming the first tensor that differs,
with a table of every run, and returns the optimized module otherwise. fxopt errors (a model
that cannot be traced, a budget that cannot be met) are raised as they are: they are not
equivalence failures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from fxopt.check import check_equivalence

__all__ = ["assert_equivalent"]


def assert_equivalent(
    model: nn.Module,
    inputs: Any,
    *,
    passes: Any = None,
    memory_budget: int | float | str | None = None,
    seeds: Sequence[int] = (0, 1),
    batch_sizes: Sequence[int] | None = None,
    tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
    leaf_modules: tuple[str, ...] = (),
    capture: str = "auto",
) -> fx.GraphModule:
    """Optimize ``model`` and assert it is equivalent on several inputs; return it. ``capture``
    is ``fxopt.optimize``'s capture frontend option ("auto", "fx" or "export")."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    result, optimized = check_equivalence(
        model, inputs, passes=passes, memory_budget=memory_budget, seeds=seeds,
        batch_sizes=batch_sizes, tolerances=tolerances, leaf_modules=leaf_modules,
        capture=capture)
    if not result.ok:
        raise AssertionError(result.failure_message())
    return optimized
