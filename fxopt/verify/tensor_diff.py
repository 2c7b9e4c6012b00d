"""Compare two recorded runs tensor by tensor: the tolerances and mismatches ``verify`` reports.

``compare_named(kind, ref, cand, tols, mismatches)`` compares two name -> value tables (gradients,
buffers), ``compare_trees`` two output pytrees leaf by leaf (containers must match too); both
append a :class:`Mismatch` per differing name and return how many names were compared on both
sides. Floating tensors pass within the per-dtype tolerance below, judged at the scale of the
values compared (the kind's and the tensor's own, so that one element that is a cancelling sum
does not decide alone); integer and bool tensors must match exactly, and NaN never passes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from fxopt.core.errors import ConfigError
from fxopt.core.trees import container_types, named_leaves, sketch

# dtype -> (rtol, atol); an element passes when
#     |candidate - reference| <= atol' + rtol * |reference|,   atol': ``atol`` at scale, see below.
# Rewrites may change the order of floating-point reductions (another kernel, a padded matmul), so
# bit equality is too strict, while every planted bug in tests/test_verify.py moves values by more
# than 1e-2. Measured on CPU: resnet18 run with channels_last kernels instead of contiguous ones
# (a benign kernel change) differs from the original by up to 3e-6 in outputs and 1e-4 in
# gradients (gradients are O(10) under random cotangents). Recomputation and graph rewrites that
# keep the kernels are bit-identical on CPU.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # eps 2.2e-16: anything above 1e-7 is a bug or a computation done in lower precision.
    torch.float64: (1e-7, 1e-7),
    # eps 1.2e-7: about 800 eps, covers the reordered reductions measured above; catches a
    # BatchNorm eps changed from 1e-5 to 1e-3 (relative change ~5e-4).
    torch.float32: (1e-4, 1e-4),
    # eps 9.8e-4: about 10 eps; half-precision checks are loose by necessity.
    torch.float16: (1e-2, 1e-2),
    # eps 7.8e-3: about 6 eps.
    torch.bfloat16: (5e-2, 5e-2),
}
# Complex tensors use the tolerance of their real dtype; every other dtype must match exactly.
#
# ``atol`` follows the scale of the values compared: an element passes when
#     |candidate - reference| <= atol' + rtol * |reference|,   with
#     atol' = max(atol * min(1, kind_scale), min(atol, SCALE_ULPS * eps) * tensor_scale).
#
# Scaled down where values are small: ``kind_scale`` is the largest finite magnitude among all
# tensors of the same kind (all outputs, all parameter gradients, ...) on either side. A fixed
# atol of 1e-4 would bless anything on tensors of scale 1e-14 (EfficientNet's logits at random
# init are that small, and a stochastic-depth mask applied in eval mode went unnoticed). The scale
# is the kind's rather than each tensor's because rounding noise follows the magnitudes flowing
# through that part of the model: a conv bias followed by BatchNorm has a gradient that is exactly
# 0 in theory, a sum of O(1) terms cancelling to 0 or to 3e-8 depending on their order.
#
# Scaled up where the tensor is large: ``tensor_scale`` is the largest finite magnitude of the
# reference tensor itself. Reordering a sum moves its result by a few units in the last place
# (ulps) of the *terms* summed, not of the result, and an element that is a cancelling sum is
# small while its terms are as large as the tensor's largest elements. Measured on CPU, 8-layer
# Llama, Qwen2 and Qwen3 (hidden 128, vocab 32000, random cotangents on the logits) optimized with
# checkpointing: gradients reach 3894 in magnitude, and rounding moves elements by up to 7.3 ulps
# of their tensor's largest magnitude; 0.04043312 vs 0.04028387 in a value-projection weight
# gradient whose largest element is 2585 (0.5 ulp of 2585, yet 1.4x the fixed atol + rtol).
# SCALE_ULPS = 64 leaves a margin of 8 and stays far below a change of function: multiplying a
# tensor by 1 + d moves its largest elements by d * tensor_scale, caught for d > rtol + 64 eps
# (1.08e-4 in float32), the same as without this term; what the term lets through is a change
# confined to elements far smaller than their tensor's largest, by less than 7.6e-6 (float32) of
# that largest. It is capped by the table's atol, so ``{dtype: (rtol, 0.0)}`` stays exact in atol.
# Never looser than the table where the kind's scale is at most 1 and the tensor's at most
# atol / (SCALE_ULPS * eps) (13 in float32).
SCALE_ULPS = 64


@dataclass(frozen=True)
class Mismatch:
    """One tensor (or name) that differs. ``max_abs_diff`` is over elements finite on both
    sides; ``max_rel_diff`` is the worst relative change ``|candidate - reference| / |reference|``
    among the elements outside tolerance (``inf`` when one of them was 0 in the reference: a 0
    that became 3.57 is no small relative change, whatever the other elements do). Both are
    ``inf`` when the difference is not a number (NaN, inf, shape, dtype, device, None, missing
    name): see ``detail``.
    """

    kind: str  # "output" | "input_grad" | "param_grad" | "buffer" | "eval_output" | "structure"
    name: str
    max_abs_diff: float
    max_rel_diff: float
    rtol: float
    atol: float
    detail: str



def merged_tolerances(overrides: Any) -> dict[torch.dtype, tuple[float, float]]:
    merged = dict(DEFAULT_TOLERANCES)
    for dtype, pair in (overrides or {}).items():
        valid = (isinstance(dtype, torch.dtype) and isinstance(pair, (tuple, list))
                 and len(pair) == 2 and all(isinstance(v, (int, float)) and v >= 0 for v in pair))
        if not valid:
            raise ConfigError(f"verify: bad tolerance entry {dtype!r}: {pair!r}",
                              hint="use {torch.float32: (rtol, atol)} with non-negative numbers")
        merged[dtype] = (float(pair[0]), float(pair[1]))
    return merged


def _tolerance(dtype: torch.dtype, tols: dict[torch.dtype, tuple[float, float]]
               ) -> tuple[float, float]:
    if dtype.is_complex:
        dtype = dtype.to_real()
    return tols.get(dtype, (0.0, 0.0))


def structure_mismatch(name: str, detail: str) -> Mismatch:
    return Mismatch("structure", name, math.inf, math.inf, 0.0, 0.0, detail)


def compare_trees(kind: str, ref: Any, cand: Any, tols: dict, mismatches: list[Mismatch]) -> int:
    """Compare two outputs leaf by leaf (walked by ``fxopt.core.trees``: dataclasses such as
    ``ModelOutput``, dict subclasses, tuples); leaves are named ``output[0]['logits']``."""
    if Counter(container_types(ref)) != Counter(container_types(cand)):
        sketches = f"{sketch(ref)[:80]} vs {sketch(cand)[:80]}"
        mismatches.append(structure_mismatch("output", f"{kind} containers differ: {sketches}"))
    named = [dict(named_leaves(tree, "output")) for tree in (ref, cand)]
    return compare_named(kind, *named, tols, mismatches)


def compare_named(kind: str, ref: dict[str, Any], cand: dict[str, Any], tols: dict,
                   mismatches: list[Mismatch]) -> int:
    for name in (n for n in ref if n not in cand):
        mismatches.append(structure_mismatch(name, f"{kind} missing in candidate"))
    for name in (n for n in cand if n not in ref):
        mismatches.append(structure_mismatch(name,
                                             f"{kind} only in candidate (not in reference)"))
    common = [name for name in ref if name in cand]
    scale = _LazyScale([*ref.values(), *cand.values()])
    for name in common:
        found = _compare_value(kind, name, ref[name], cand[name], tols, scale)
        if found is not None:
            mismatches.append(found)
    return len(common)


class _LazyScale:
    """The kind's scale, computed on first use: bit-identical tensors never need it."""

    def __init__(self, values: list[Any]):
        self._values: list[Any] | None = values
        self._scale = 0.0

    def __float__(self) -> float:
        if self._values is not None:
            self._scale, self._values = _largest_magnitude(self._values), None
        return self._scale


def _largest_magnitude(values: list[Any]) -> float:
    """The largest finite magnitude among the floating tensors in ``values`` (0 if none)."""
    largest = 0.0
    for t in values:
        if (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
                and t.numel() and t.device.type != "meta"):
            for piece in _pieces(t.detach().reshape(-1)):
                magnitudes = piece.abs()  # exact in any precision, and so is the max
                largest = max(largest, float(torch.where(torch.isfinite(magnitudes), magnitudes,
                                                         0.0).max()))
    return largest


# Elements compared at a time: the float64 temporaries of a comparison (both sides, the
# differences, magnitudes and masks: about 40 bytes an element) are those of one piece, not of
# the whole tensor (a 2 x 2048 x 128256 logits tensor would take 20 GB of device memory).
PIECE = 1 << 22


def _pieces(flat: torch.Tensor) -> list[torch.Tensor]:
    """``flat`` (1-d) in views of at most ``PIECE`` elements, in order."""
    return [flat[start:start + PIECE] for start in range(0, flat.numel(), PIECE)]


def _compare_value(kind: str, name: str, ref: Any, cand: Any, tols: dict,
                   scale: _LazyScale) -> Mismatch | None:
    ref_is_tensor, cand_is_tensor = isinstance(ref, torch.Tensor), isinstance(cand, torch.Tensor)
    if ref_is_tensor and cand_is_tensor:
        return _compare_tensors(kind, name, ref, cand, tols, scale)
    if getattr(type(cand), "fxopt_not_computed", False) and (
            ref_is_tensor or getattr(type(ref), "fxopt_not_computed", False)):
        return None  # passes.chunked_loss(outputs="loss"): left out at the user's request
    if ref_is_tensor or cand_is_tensor:
        sides = ["tensor" if is_tensor else _describe(v)
                 for is_tensor, v in ((ref_is_tensor, ref), (cand_is_tensor, cand))]
        return Mismatch(kind, name, math.inf, math.inf, 0.0, 0.0, f"{sides[0]} vs {sides[1]}")
    try:
        same = type(ref) is type(cand) and bool(ref == cand)
    except Exception:  # an object whose == does not give a truth value cannot be shown equal
        same = False
    if same:
        return None
    return Mismatch(kind, name, math.inf, math.inf, 0.0, 0.0, f"value {ref!r} vs {cand!r}")


def _describe(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _compare_tensors(kind: str, name: str, ref: torch.Tensor, cand: torch.Tensor,
                     tols: dict, scale: _LazyScale) -> Mismatch | None:
    def mismatch(detail: str, abs_diff: float = math.inf, rel_diff: float = math.inf,
                 rtol: float = 0.0, atol: float = 0.0) -> Mismatch:
        return Mismatch(kind, name, abs_diff, rel_diff, rtol, atol, detail)

    for what, r, c in (("device", ref.device, cand.device), ("dtype", ref.dtype, cand.dtype),
                       ("layout", ref.layout, cand.layout),
                       ("shape", tuple(ref.shape), tuple(cand.shape))):
        if r != c:
            return mismatch(f"{what} {r} vs {c}")
    rtol, atol = _tolerance(ref.dtype, tols)
    ref, cand = ref.detach(), cand.detach()
    if ref.layout != torch.strided:
        ref, cand = ref.to_dense(), cand.to_dense()
    if ref.numel() == 0 or torch.equal(ref, cand):  # equal never holds with a NaN
        return None
    exact = not (ref.is_floating_point() or ref.is_complex())
    if ref.is_floating_point() and _clearly_within(ref.reshape(-1), cand.reshape(-1), rtol,
                                                   min(atol, SCALE_ULPS
                                                       * torch.finfo(ref.dtype).eps)):
        return None
    wide = torch.complex128 if ref.is_complex() else torch.float64
    flat_ref, flat_cand = ref.reshape(-1), cand.reshape(-1)
    shape = tuple(ref.shape)
    # Compared a piece at a time (``PIECE``), in two passes (the tolerance depends on the
    # tensor's largest magnitude); every figure is a max, a sum or a first index over the
    # pieces, so it is the one a comparison of the whole tensor at once gives.
    one = [(0, flat_ref.to(wide), flat_cand.to(wide))] if flat_ref.numel() <= PIECE else None

    def wide_pieces() -> Any:
        """(start, reference, candidate) of each piece, widened (once, for a single piece)."""
        if one is not None:
            return one
        return ((start, b.to(wide), a.to(wide)) for start, b, a in
                zip(range(0, flat_ref.numel(), PIECE), _pieces(flat_ref), _pieces(flat_cand)))

    def value(flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[i].to(wide)

    def measured(b: torch.Tensor, a: torch.Tensor) -> tuple:
        """(finite, diff, magnitude) of a piece."""
        finite = ~(torch.isinf(a) | torch.isinf(b))
        return finite, torch.where(finite, (a - b).abs(), 0.0), b.abs()

    nan_ref = nan_cand = bad_inf = None
    max_abs, tensor_scale = 0.0, 0.0
    kept = None  # a single piece's figures, for the second pass
    for start, b, a in wide_pieces():
        nan_b, nan_a = torch.isnan(b), torch.isnan(a)
        if nan_ref is None and bool(nan_b.any()):
            nan_ref = start + _first(nan_b)
        if nan_cand is None and bool(nan_a.any()):
            nan_cand = start + _first(nan_a)
        if nan_ref is not None or nan_cand is not None:
            continue
        finite, diff, magnitude = figures = measured(b, a)
        wrong = ~finite & (a != b)
        if bad_inf is None and bool(wrong.any()):
            bad_inf = start + _first(wrong)
        max_abs = max(max_abs, float(diff.max()))
        tensor_scale = max(tensor_scale, float(torch.where(torch.isfinite(b), magnitude,
                                                           0.0).max()))
        kept = figures if one is not None else None
    if nan_ref is not None:
        also = " (and in candidate)" if bool(torch.isnan(value(flat_cand, nan_ref))) else ""
        return mismatch(f"NaN in reference at index {_position(nan_ref, shape)}{also}",
                        rtol=rtol, atol=atol)
    if nan_cand is not None:
        return mismatch(f"NaN in candidate at index {_position(nan_cand, shape)}",
                        rtol=rtol, atol=atol)
    if bad_inf is not None:
        return mismatch(f"inf must match exactly; at index {_position(bad_inf, shape)}: "
                        f"reference {_fmt(value(flat_ref, bad_inf))} vs candidate "
                        f"{_fmt(value(flat_cand, bad_inf))}", rtol=rtol, atol=atol)

    if not exact:
        atol = _scaled_atol(ref.dtype, atol, float(scale), tensor_scale)
    count, max_rel, worst, worst_excess = 0, 0.0, None, -math.inf
    for start, b, a in wide_pieces():
        finite, diff, magnitude = kept if kept is not None else measured(b, a)
        if exact:
            outside = (flat_ref[start:start + PIECE] != flat_cand[start:start + PIECE])
        else:
            excess = torch.where(finite, diff - (atol + rtol * magnitude), -math.inf)
            outside = excess > 0
        if not bool(outside.any()):
            continue
        count += int(outside.sum())
        max_rel = max(max_rel, _worst_relative(diff, magnitude, outside))
        if exact:
            if worst is None:
                worst = start + _first(outside)
        else:
            i = int(excess.argmax())  # the first of the piece's largest
            if float(excess[i]) > worst_excess:  # strictly: the first piece's on a tie
                worst, worst_excess = start + i, float(excess[i])
    if not count:
        return None
    b_i, a_i = value(flat_ref, worst), value(flat_cand, worst)
    if exact:
        return mismatch(f"{count} of {flat_ref.numel()} elements differ (exact match "
                        f"required for {ref.dtype}); first at index {_position(worst, shape)}: "
                        f"reference {_fmt(b_i)} vs candidate {_fmt(a_i)}", max_abs, max_rel)
    return mismatch(f"{count} of {flat_ref.numel()} elements outside tolerance; worst at "
                    f"index {_position(worst, shape)}: reference {_fmt(b_i)} vs candidate "
                    f"{_fmt(a_i)}",
                    max_abs, max_rel, rtol, atol)


def _clearly_within(flat_ref: torch.Tensor, flat_cand: torch.Tensor, rtol: float,
                    scaled_atol: float) -> bool:
    """Whether every element is finite on both sides and within half the tolerance the rule above
    grants it at the least, ``min(atol, SCALE_ULPS * eps) * tensor_scale + rtol * |reference|``
    (the kind's scale can only raise it), judged in float32 (float64 for float64 tensors).

    A fast path: the rounding of float32 arithmetic is far below the factor of 2 kept in hand,
    so an element it passes passes the float64 comparison too. Anything else (a NaN, an inf, an
    element near its tolerance) goes to the exact comparison, which reports it."""
    work = torch.float64 if flat_ref.dtype == torch.float64 else torch.float32
    largest = 0.0
    for b, a in zip(_pieces(flat_ref), _pieces(flat_cand)):
        b, a = b.to(work), a.to(work)
        if not bool((torch.isfinite(b) & torch.isfinite(a)).all()):
            return False
        largest = max(largest, float(b.abs().max()))
    floor = scaled_atol * largest
    for b, a in zip(_pieces(flat_ref), _pieces(flat_cand)):
        b, a = b.to(work), a.to(work)
        if not bool(((a - b).abs() <= (floor + rtol * b.abs()) * 0.5).all()):
            return False
    return True


def _worst_relative(diff: torch.Tensor, magnitude: torch.Tensor, outside: torch.Tensor) -> float:
    """The largest ``diff / magnitude`` among the ``outside`` elements; ``inf`` when one of them
    has a reference of 0 (any change of a 0 is an unbounded relative change)."""
    if bool((outside & (magnitude == 0)).any()):
        return math.inf
    return float(torch.where(outside, diff / torch.where(outside, magnitude, 1.0), 0.0).max())


def _scaled_atol(dtype: torch.dtype, atol: float, kind_scale: float,
                 tensor_scale: float) -> float:
    """``atol'`` of the rule above: ``atol`` at the kind's scale, or a few ulps of the tensor's
    largest magnitude, whichever is larger."""
    eps = torch.finfo(dtype.to_real() if dtype.is_complex else dtype).eps
    return max(atol * min(1.0, kind_scale), min(atol, SCALE_ULPS * eps) * tensor_scale)


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _position(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    position = []
    for size in reversed(shape):
        flat_index, i = divmod(flat_index, size)
        position.append(i)
    return tuple(reversed(position))


def _fmt(value: torch.Tensor) -> str:
    item = value.item()
    return str(item) if isinstance(item, complex) else f"{item:.7g}"
