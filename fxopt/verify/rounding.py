"""Tell rounding from a change of function: ``verify``'s float64 re-check.

Floating-point addition is not associative, so a rewrite that changes *when* things are computed
can change the last bits of a result without changing the function: reordering the forward
changes the order in which autograd accumulates the gradient of a tensor used by several
branches. Usually that stays far inside the float32 tolerance, but BatchNorm over a handful of
values (batch 2 at 2x2 pixels, deep in a small-input model) cancels most of its input gradient
and amplifies those last bits a thousandfold: GoogLeNet's gradients then differ by 1e-3 relative.

When every float32 mismatch is a finite difference (never NaN, inf, a shape, dtype or structure
change), ``recheck_in_float64`` runs float64 copies of both models on float64 inputs. The
candidate is accepted only if

1. in float64 it equals the reference within the float64 tolerance (1e-7: a real change of
   function, which is as large in float64 as in float32, fails here), and
2. its float32 results are no less accurate than the original's: for each tensor that differed,
   the largest error against the float64 reference is at most ``ACCURACY_FACTOR`` times the
   original float32 model's own largest error (a rewrite that loses precision, e.g.
   ``log(softmax(x))`` for ``log_softmax(x)``, fails here).

Not handled: models that cannot be deep-copied or that fail in float64 (the float32 verdict then
stands, and each mismatch says why it was not re-checked), and dropout masks that depend on the
dtype (both float64 copies draw the same masks, so check 1 is still sound; check 2 then only
bounds the error loosely).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxopt.core.torch_private import (
    tree_leaves,
    tree_map,
)
from fxopt.core.trees import named_leaves

ACCURACY_FACTOR = 10.0


def explainable_by_rounding(mismatches: list[Any]) -> bool:
    """Whether every mismatch is a finite numeric difference (the only kind rounding makes)."""
    return bool(mismatches) and all(
        m.kind != "structure" and math.isfinite(m.max_abs_diff) for m in mismatches)


def _below_float64(modules: tuple[nn.Module, ...], args: tuple) -> bool:
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    return any(t.is_floating_point() and t.dtype != torch.float64 for t in tensors)


def float64_copies(reference: nn.Module, candidate: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Deep copies of both models in float64, sharing between them what they shared."""
    ref64, cand64 = copy.deepcopy((reference, candidate))  # one memo: shared stays shared
    return ref64.double(), cand64.double()


def _noted(mismatches: list[Any], why: str) -> list[Any]:
    """The float32 mismatches, saying why the float64 re-check could not decide them."""
    return [dataclasses.replace(m, detail=f"{m.detail} (no float64 re-check: {why})")
            for m in mismatches]


def to_float64(args: tuple) -> tuple:
    return tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point()
                    else x, args)


def value_of(record: Any, kind: str, name: str) -> Any:
    """The value a record holds for a mismatch's (kind, name)."""
    if kind in ("output", "eval_output"):
        tree = record.outputs if kind == "output" else record.eval_outputs
        return dict(named_leaves(tree, "output")).get(name)
    table = {"input_grad": record.input_grads, "param_grad": record.param_grads,
             "buffer": record.buffers}[kind]
    return (table or {}).get(name)


def _max_error(value: Any, truth: Any) -> float:
    if not (isinstance(value, torch.Tensor) and isinstance(truth, torch.Tensor)):
        return math.inf
    return float((value.double() - truth.double()).abs().max()) if value.numel() else 0.0


def _rounding_unit(value: Any, truth: Any) -> float:
    """A few units in the last place of ``value``'s dtype at the scale of ``truth``."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and truth.numel()):
        return 0.0
    return 4 * torch.finfo(value.dtype).eps * float(truth.double().abs().max())


def recheck_in_float64(reference: nn.Module, candidate: nn.Module, args: tuple,
                       records32: list[Any], mismatches32: list[Any],
                       run: Callable[[nn.Module, nn.Module, tuple], list[Any]],
                       compare: Callable[[Any, Any], Any]) -> tuple[bool, list[Any]]:
    """``(equal, mismatches)``: equal when every float32 mismatch is rounding (see module doc).

    ``run(ref, cand, args)`` returns the two records of a verify run, ``compare(ref, cand)`` the
    report comparing them. When not equal, the mismatches returned are the float32 ones, with
    the reason the float64 re-check gave appended to a mismatch where it has one.
    """
    if not _below_float64((reference, candidate), args):
        return False, mismatches32
    try:
        records64 = run(*float64_copies(reference, candidate), to_float64(args))
    except Exception as error:  # cannot copy, no float64 kernel: the float32 verdict stands
        return False, _noted(mismatches32, f"{type(error).__name__}: {error}"[:120])
    if not compare(*records64).ok:
        return False, mismatches32
    less_accurate = []
    for m in mismatches32:
        truth = value_of(records64[0], m.kind, m.name)
        original = _max_error(value_of(records32[0], m.kind, m.name), truth)
        candidate_value = value_of(records32[1], m.kind, m.name)
        rewritten = _max_error(candidate_value, truth)
        slack = m.atol + _rounding_unit(candidate_value, truth)  # noise either order may show
        if rewritten > ACCURACY_FACTOR * original + slack:
            less_accurate.append(dataclasses.replace(m, detail=(
                f"{m.detail}; equal in float64, but in float32 its error against float64 is "
                f"{rewritten:.3g}, the original's {original:.3g}: the rewrite loses precision")))
    return not less_accurate, less_accurate or mismatches32
