"""Prove a rewritten model computes the same function.

- ``equivalence``: ``verify`` (outputs, gradients, buffers, eval outputs) and ``VerifyReport``.
- ``tensor_diff``: tolerances and tensor-by-tensor comparison of two recorded runs.
- ``rounding``: the float64 re-check that tells rounding from a change of function.
"""

from fxopt.verify.equivalence import VerifyReport, verify

__all__ = ["VerifyReport", "verify"]
