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

from typing import Any

from torch import fx, nn

from fxopt.check import check_equivalence

__all__ = ["assert_equivalent"]


def assert_equivalent(model: nn.Module, inputs: Any, **options: Any) -> fx.GraphModule:
    """Optimize ``model`` and assert it is equivalent on several inputs; return it.

    ``options`` are ``fxopt.check.check_equivalence``'s: ``passes``, ``memory_budget``,
    ``seeds`` (default (0, 1)), ``batch_sizes`` (default: the example's), ``tolerances``,
    ``leaf_modules``, ``capture`` ("auto", "fx" or "export"), ``dynamic`` and
    ``example_kwargs``.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    result, optimized = check_equivalence(model, inputs, **options)
    if not result.ok:
        raise AssertionError(result.failure_message())
    return optimized
