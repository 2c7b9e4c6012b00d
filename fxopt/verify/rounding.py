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

When the candidate cannot run in float64 but the original can (a graph captured by
``torch.export`` has its float32 dtypes built in: ``_assert_tensor_metadata`` nodes, casts to
float32, an input guard that refuses other dtypes), check 1 is impossible and the float64 run of
the *original* alone decides, as ``torch._dynamo``'s accuracy checks do: for each tensor that
differed, the candidate's float32 error against it must be within ``ORIGINAL_ERROR_FACTOR``
times the original float32 model's own error (plus 4 ulps of the tensor's largest value, the
noise either order may show), both in the largest element (a change confined to a few
elements) and in root mean square (a change spread over the tensor). This is sound to
the resolution the original itself has: a change of function passes only if it is smaller than
a few times the original float32 model's own distance from its float64 run, in every tensor
that differed. It is weaker than check 1 there, which is why check 1 is used whenever it can be.

The original-only check also requires the original's float32 results to agree with its float64
run within ``REFERENCE_CEILING`` (1%) of the tensor's largest magnitude (``sqrt(eps)`` for the
half-precision dtypes, whose rounding alone reaches that): where they do not, the float64 run is
not the same computation (random numbers drawn differently in float64, a model that branches on
the dtype) and cannot serve as the reference. Rounding stays far below: 1e-3 relative in the
worst amplified case known (GoogLeNet's BatchNorm, above).

Not handled: models whose original cannot be deep-copied or fails in float64 (the float32 verdict
then stands, and each mismatch says why it was not re-checked), and dropout masks that depend on
the dtype (both float64 copies draw the same masks, so check 1 is still sound; check 2 then only
bounds the error loosely; the original-only check refuses a float64 run of the original that
differs from its float32 run by more than ``REFERENCE_CEILING``).
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
# Without check 1 (the candidate cannot run in float64), how much further from the original's
# float64 run than the original's own float32 results the candidate may be, in the largest element
# and in root mean square. Measured on CPU (8-layer Llama, Qwen2, Qwen3, rounding of reordered
# sums): the candidate's error is 0.6 to 1.6 times the original's in the largest element, 0.95 to
# 1.12 times in root mean square.
ORIGINAL_ERROR_FACTOR = 4.0
# How far (relative to the tensor's largest magnitude) the original's float32 results may be from
# its float64 run for that run to serve as the reference of the original-only check.
REFERENCE_CEILING = 1e-2
# Said in the detail of every difference the original-only check calls rounding.
ORIGINAL_ONLY = "the candidate cannot run in float64"


def explainable_by_rounding(mismatches: list[Any]) -> bool:
    """Whether every mismatch is a finite numeric difference (the only kind rounding makes)."""
    return bool(mismatches) and all(
        m.kind != "structure" and math.isfinite(m.max_abs_diff) for m in mismatches)


def _below_float64(modules: tuple[nn.Module, ...], args: tuple) -> bool:
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    return any(t.is_floating_point() and t.dtype != torch.float64 for t in tensors)


def float64_copies(reference: nn.Module, candidate: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Deep copies of both models in float64, sharing between them what they shared.

    Each floating parameter and buffer (and gradient) is copied straight to float64, so the
    copies take the float64 weights and nothing more: no transient copy in the models' own dtype
    first. (On the device, that float64 copy of the weights is what the re-check costs: 4x the
    weights of a bfloat16 model.)"""
    memo: dict[int, Any] = {}  # one memo: shared stays shared
    for module in (reference, candidate):
        for t in (*module.parameters(), *module.buffers()):
            if id(t) not in memo and type(t) in (torch.Tensor, nn.Parameter) and (
                    t.is_floating_point()):
                memo[id(t)] = _in_float64(t)
    ref64, cand64 = copy.deepcopy((reference, candidate), memo)
    return ref64.double(), cand64.double()


def _in_float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to float64 as ``copy.deepcopy(t).double()`` would leave it in a module."""
    wide = t.detach().to(torch.float64, copy=True)
    if isinstance(t, nn.Parameter):
        wide = nn.Parameter(wide, requires_grad=t.requires_grad)
    else:
        wide.requires_grad_(t.requires_grad)
    if t.grad is not None:
        wide.grad = t.grad.detach().to(torch.float64, copy=True)
    return wide


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
                       record: Callable[[nn.Module, tuple[nn.Module, nn.Module], tuple], Any],
                       compare: Callable[[Any, Any], Any]) -> tuple[bool, list[Any]]:
    """``(equal, mismatches)``: equal when every float32 mismatch is rounding (see module doc).

    ``record(model, (ref, cand), args)`` returns the record of one model's verify run (the pair:
    whose state to preserve, whose names to use), ``compare(ref, cand)`` the report comparing two
    records. When equal, the mismatches returned are the float32 ones, as rounding (noting how
    they were judged where the candidate could not run in float64); when not, the float32 ones
    with the reason the float64 re-check gave appended to a mismatch where it has one.
    """
    if not _below_float64((reference, candidate), args):
        return False, mismatches32
    try:
        ref64, cand64 = float64_copies(reference, candidate)
        args64 = to_float64(args)
        truth = record(ref64, (ref64, cand64), args64)
    except Exception as error:  # cannot copy, no float64 kernel: the float32 verdict stands
        return False, _noted(mismatches32, _why(error))
    try:
        candidate64 = record(cand64, (ref64, cand64), args64)
    except Exception as error:  # e.g. dtypes built into an exported graph: the original decides
        return _against_the_original(truth, records32, mismatches32, _why(error))
    if not compare(truth, candidate64).ok:
        return False, mismatches32
    less_accurate = []
    for m in mismatches32:
        truth_value = value_of(truth, m.kind, m.name)
        original = _max_error(value_of(records32[0], m.kind, m.name), truth_value)
        candidate_value = value_of(records32[1], m.kind, m.name)
        rewritten = _max_error(candidate_value, truth_value)
        slack = m.atol + _rounding_unit(candidate_value, truth_value)  # noise either order may show
        if rewritten > ACCURACY_FACTOR * original + slack:
            less_accurate.append(dataclasses.replace(m, detail=(
                f"{m.detail}; equal in float64, but in float32 its error against float64 is "
                f"{rewritten:.3g}, the original's {original:.3g}: the rewrite loses precision")))
    return not less_accurate, less_accurate or mismatches32


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:120]


def _against_the_original(truth: Any, records32: list[Any], mismatches32: list[Any],
                          why: str) -> tuple[bool, list[Any]]:
    """The original-only check (module doc): each mismatch's candidate value against the float64
    run of the original, allowed ``ORIGINAL_ERROR_FACTOR`` times the original's own error."""
    verdicts = [(m, _original_only_verdict(m, truth, records32)) for m in mismatches32]
    failed = [dataclasses.replace(m, detail=f"{m.detail} (no float64 run of the candidate: "
                                            f"{why}; {verdict})")
              for m, (ok, verdict) in verdicts if not ok]
    if failed:
        return False, failed
    return True, [dataclasses.replace(m, detail=f"{m.detail}; {verdict} ({ORIGINAL_ONLY}: "
                                                f"{why})")
                  for m, (_, verdict) in verdicts]


def _original_only_verdict(m: Any, truth: Any, records32: list[Any]) -> tuple[bool, str]:
    """``(as accurate, why)`` for one mismatch, judged against the original's float64 run."""
    exact = value_of(truth, m.kind, m.name)
    original, rewritten = (value_of(r, m.kind, m.name) for r in records32)
    values = (exact, original, rewritten)
    if not (all(isinstance(v, torch.Tensor) for v in values)
            and exact.shape == original.shape == rewritten.shape and exact.numel()):
        return False, "the original's float64 run has no comparable value"
    wide = torch.complex128 if exact.is_complex() else torch.float64
    exact = exact.detach().to(wide)
    errors = [(v.detach().to(wide) - exact).abs().reshape(-1) for v in (original, rewritten)]
    if not all(bool(torch.isfinite(e).all()) for e in errors):
        return False, "not finite against the original's float64 run"
    (max_o, rms_o), (max_c, rms_c) = ((float(e.max()), float(e.pow(2).mean().sqrt()))
                                      for e in errors)
    largest = float(exact.abs().max())
    finfo = torch.finfo(original.dtype.to_real() if original.dtype.is_complex else original.dtype)
    if max_o > max(REFERENCE_CEILING, math.sqrt(finfo.eps)) * largest:
        return False, (f"the original's float32 error against its float64 run, {max_o:.3g}, is "
                       f"more than rounding (its largest value is {largest:.3g}): the float64 run "
                       "cannot serve as the reference")
    unit = 4 * finfo.eps * largest  # a few ulps at the tensor's scale: noise either order may show
    ok = (max_c <= ORIGINAL_ERROR_FACTOR * max_o + unit
          and rms_c <= ORIGINAL_ERROR_FACTOR * rms_o + unit)
    verdict = (f"against the original's float64 run, its float32 error is {max_c:.3g} at most and "
               f"{rms_c:.3g} in root mean square, the original's {max_o:.3g} and {rms_o:.3g}")
    return ok, (f"{verdict}: no less accurate than the original" if ok
                else f"{verdict}: more than {ORIGINAL_ERROR_FACTOR:g} times the original's error, "
                     "not rounding")
