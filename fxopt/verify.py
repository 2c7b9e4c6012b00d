"""Prove a rewritten model computes the same function as the original: ``verify``.

``verify(reference, candidate, example_inputs)`` runs one training step of each model (train mode,
the same seed, the same starting state, the same cotangents from :mod:`fxopt.step`) and compares:

- forward outputs (any pytree: tuple, list, dict, namedtuple, ``None`` leaves),
- gradients of the floating-point inputs and of every parameter, by qualified name (a gradient
  that is None on one side only is a mismatch),
- every buffer after the step (BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``),
- then eval-mode outputs under ``torch.no_grad``.

Safe with shared state: the two models may share Parameter and buffer objects (fxopt's optimized
GraphModule owns the user's). Each run starts from the state the models had on entry (grads None,
buffers as they were, the RNG seeded with ``seed``); after the call every ``.grad`` (the same
object), buffer value, training flag and the CPU/CUDA RNG state is exactly as before. The example
inputs are cloned, never modified. A candidate parameter or buffer that *is* a reference tensor
is compared under the reference's name; otherwise tensors are matched by their own names, and a
name on one side only is a ``"structure"`` mismatch.

Differences that are only finite numbers outside the tolerance get a second look in float64
(:mod:`fxopt.rounding`): if both models agree in float64 and the candidate's float32 results are
no less accurate than the original's, the differences are rounding (the order of a gradient
accumulation, amplified by an ill-conditioned BatchNorm) and are listed as ``rounding``, not as
mismatches.

Never blessed: NaN anywhere (even NaN in both at the same place), infinities that differ, a dtype,
shape or device change. Integer and bool tensors must match exactly.

Not handled: Python attributes a forward mutates (only parameters and buffers are restored);
buffers a forward *replaces* instead of updating in place; non-strided tensors other than sparse
(compared dense); run-to-run noise of nondeterministic CUDA kernels beyond the tolerances. Every
submodule runs in train mode for the step, overriding per-submodule modes (a BatchNorm frozen in
eval), and floating inputs require grad during the step.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten_with_path,
    tree_map,
    tree_structure,
    tree_unflatten,
)

from fxopt.errors import ConfigError, EquivalenceError, FxoptError, InputError
from fxopt.inputs import refuse_meta_tensors
from fxopt.rounding import explainable_by_rounding, recheck_in_float64
from fxopt.state import preserved_state
from fxopt.step import as_args, backward_from

# dtype -> (rtol, atol); an element passes when
#     |candidate - reference| <= atol * min(1, scale) + rtol * |reference|   (scale: see below).
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
# ``atol`` is scaled down where values are small: an element passes when
#     |candidate - reference| <= atol * min(1, scale) + rtol * |reference|,
# with ``scale`` the largest finite magnitude among all tensors of the same kind (all outputs,
# all parameter gradients, ...) on either side. A fixed atol of 1e-4 would bless anything on
# tensors of scale 1e-14 (EfficientNet's logits at random init are that small, and a
# stochastic-depth mask applied in eval mode went unnoticed). The scale is the kind's rather than
# each tensor's because rounding noise follows the magnitudes flowing through that part of the
# model: a conv bias followed by BatchNorm has a gradient that is exactly 0 in theory, a sum of
# O(1) terms cancelling to 0 or to 3e-8 depending on their order. Never looser than the table.

_TABLE_ROWS = 10


@dataclass(frozen=True)
class Mismatch:
    """One tensor (or name) that differs. ``max_abs_diff``/``max_rel_diff`` are over elements
    finite on both sides (relative: over nonzero reference elements); they are ``inf`` when the
    difference is not a number (NaN, inf, shape, dtype, device, None, missing name): see ``detail``.
    """

    kind: str  # "output" | "input_grad" | "param_grad" | "buffer" | "eval_output" | "structure"
    name: str
    max_abs_diff: float
    max_rel_diff: float
    rtol: float
    atol: float
    detail: str


@dataclass
class VerifyReport:
    """``checked``: kind -> number of names (tensors, output leaves) compared on both sides."""

    ok: bool
    mismatches: list[Mismatch]
    checked: dict[str, int]
    # float32 differences shown to be rounding (equal in float64, no less accurate): not failures
    rounding: list[Mismatch] = field(default_factory=list)

    def worst(self) -> list[Mismatch]:
        """Mismatches, the ones that are not a number first, then by largest absolute difference."""
        return sorted(self.mismatches, key=lambda m: m.max_abs_diff, reverse=True)

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {kind}" for kind, n in self.checked.items())
        if self.ok and self.rounding:
            worst = max(m.max_rel_diff for m in self.rounding)
            return (f"equivalent: {counts} compared; {len(self.rounding)} float32 difference(s) "
                    f"(up to {worst:.2g} relative) are rounding: equal in float64, and no less "
                    "accurate than the original")
        if self.ok:
            return f"equivalent: {counts} compared, all within tolerance"
        lines = [f"NOT equivalent: {len(self.mismatches)} mismatch(es) ({counts} compared)",
                 f"  {'kind':<12}{'name':<36}{'max abs':>10}{'max rel':>10}{'rtol':>8}{'atol':>8}"
                 "  detail"]
        for m in self.worst()[:_TABLE_ROWS]:
            lines.append(f"  {m.kind:<12}{m.name:<36}{m.max_abs_diff:>10.3g}{m.max_rel_diff:>10.3g}"
                         f"{m.rtol:>8.0e}{m.atol:>8.0e}  {m.detail}")
        if len(self.mismatches) > _TABLE_ROWS:
            lines.append(f"  ... and {len(self.mismatches) - _TABLE_ROWS} more")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite differences become None (JSON has no inf)."""
        return {
            "ok": self.ok,
            "checked": dict(self.checked),
            "mismatches": [_mismatch_dict(m) for m in self.worst()],
            "rounding": [_mismatch_dict(m) for m in self.rounding],
        }


def _mismatch_dict(m: Mismatch) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in asdict(m).items()}


@dataclass
class _Record:
    """Everything one run produced, detached from the live models."""

    outputs: Any = None
    input_grads: dict[str, torch.Tensor | None] | None = None
    param_grads: dict[str, torch.Tensor | None] | None = None
    buffers: dict[str, torch.Tensor] | None = None
    eval_outputs: Any = None


def verify(
    reference: nn.Module,
    candidate: nn.Module,
    example_inputs: Any,
    *,
    seed: int = 0,
    tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
    check_eval: bool = True,
    check_grads: bool = True,
    strict: bool = False,
    recheck_float64: bool = True,
) -> VerifyReport:
    """Compare one training step (and one eval forward) of ``candidate`` against ``reference``.

    ``tolerances`` overrides :data:`DEFAULT_TOLERANCES` per dtype. ``strict=True`` raises
    :class:`~fxopt.errors.EquivalenceError` (carrying the report as ``.report``) on any mismatch.
    ``recheck_float64``: when the only differences are finite numbers, decide in float64 whether
    they are rounding (see :mod:`fxopt.rounding`); the report lists them under ``rounding``.
    """
    args = _checked_inputs(reference, candidate, example_inputs)
    tols = _merged_tolerances(tolerances)
    canonical = {id(t): n for n, t in [*reference.named_parameters(), *reference.named_buffers()]}
    records = [_record(m, (reference, candidate), args, seed, check_grads, check_eval, canonical)
               for m in (reference, candidate)]
    report = _compare_records(*records, tols, check_grads, check_eval)
    if not report.ok and recheck_float64 and explainable_by_rounding(report.mismatches):
        def run(ref: nn.Module, cand: nn.Module, inputs: tuple) -> list[_Record]:
            names = {id(t): n for n, t in [*ref.named_parameters(), *ref.named_buffers()]}
            return [_record(m, (ref, cand), inputs, seed, check_grads, check_eval, names)
                    for m in (ref, cand)]

        equal, mismatches = recheck_in_float64(
            reference, candidate, args, records, report.mismatches, run,
            lambda ref, cand: _compare_records(ref, cand, tols, check_grads, check_eval))
        rounding = report.mismatches if equal else []
        report = VerifyReport(ok=equal, mismatches=[] if equal else mismatches,
                              checked=report.checked, rounding=rounding)
    if strict and not report.ok:
        raise _equivalence_error(report)
    return report


def _checked_inputs(reference: Any, candidate: Any, example_inputs: Any) -> tuple:
    for role, module in (("reference", reference), ("candidate", candidate)):
        if not isinstance(module, nn.Module):
            raise InputError(f"verify: the {role} is a {type(module).__name__}, "
                             "not a torch.nn.Module",
                             hint="pass the model objects themselves (nn.Module or fx.GraphModule)")
    args = as_args(example_inputs)
    leaves, _ = tree_flatten_with_path(args)
    for path, leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, bool, int, float, complex, str, type(None))):
            raise InputError(f"verify: example input is a {type(leaf).__name__}, not a tensor",
                             where=f"input{keystr(path)}",
                             hint="pass torch tensors (e.g. torch.as_tensor(value))")
    if not any(isinstance(leaf, torch.Tensor) for _, leaf in leaves):
        raise InputError("verify: example_inputs contain no tensor",
                         hint="pass a tensor or a tuple/list/dict of tensors the model accepts")
    refuse_meta_tensors("verify", reference, args)
    return args


def _merged_tolerances(overrides: Any) -> dict[torch.dtype, tuple[float, float]]:
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


# ---------------------------------------------------------------------------------------------
# Running the models


def _seed_rng(seed: int) -> None:
    # Not torch.manual_seed: that would queue a seed for a CUDA runtime not yet initialised,
    # which preserved_rng cannot undo.
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def _named(module: nn.Module, kind: str, canonical: dict[int, str]) -> dict[str, torch.Tensor]:
    """Parameters or buffers by name; a reference tensor keeps the reference's name."""
    named = module.named_parameters() if kind == "params" else module.named_buffers()
    return {canonical.get(id(t), name): t for name, t in named}


def _detached_clone(tree: Any) -> Any:
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def _fresh_inputs(args: tuple, requires_grad: bool) -> tuple[tuple, dict[str, torch.Tensor]]:
    """Clones of the inputs to call with, and the grad-requiring leaves by name."""
    leaves: dict[str, torch.Tensor] = {}

    def fresh(path: Any, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach().clone()
        if requires_grad and x.is_floating_point():
            leaves[f"input{keystr(path)}"] = x.requires_grad_(True)
            return x.clone()  # a non-leaf, so a forward may update its input in place
        return x

    flat, spec = tree_flatten_with_path(args)
    return tree_unflatten([fresh(path, x) for path, x in flat], spec), leaves


def _record(module: nn.Module, both: tuple[nn.Module, nn.Module], args: tuple, seed: int,
            check_grads: bool, check_eval: bool, canonical: dict[int, str]) -> _Record:
    role = "reference" if module is both[0] else "candidate"
    record = _Record()
    with preserved_state(*both), torch.enable_grad():
        for other in both:
            for p in other.parameters():
                p.grad = None
        _seed_rng(seed)
        module.train()
        call_args, input_leaves = _fresh_inputs(args, requires_grad=check_grads)
        with _failure_reported(role, "train-mode forward"):
            output = module(*call_args)
        record.outputs = _detached_clone(output)
        if check_grads:
            with _failure_reported(role, "backward"):
                backward_from(output)
            record.input_grads = {n: x.grad for n, x in input_leaves.items()}
            record.param_grads = {n: p.grad for n, p in _named(module, "params", canonical).items()}
        del output
        buffers = _named(module, "buffers", canonical)
        record.buffers = {n: b.detach().clone() for n, b in buffers.items()}
    if check_eval:
        with preserved_state(*both), torch.no_grad():
            _seed_rng(seed)
            module.eval()
            call_args, _ = _fresh_inputs(args, requires_grad=False)
            with _failure_reported(role, "eval-mode forward"):
                record.eval_outputs = _detached_clone(module(*call_args))
    return record


@contextlib.contextmanager
def _failure_reported(role: str, stage: str) -> Iterator[None]:
    """Turn a crash of either model into an fxopt error naming the model and the stage."""
    try:
        yield
    except FxoptError:
        raise
    except Exception as exc:
        what = f"verify: the {role} raised {type(exc).__name__} in its {stage}: {exc}"
        if role == "reference":
            raise InputError(what, where=f"reference {stage}",
                             hint="check that the model runs a forward and a backward on these "
                                  "example inputs without fxopt") from exc
        raise EquivalenceError(what, where=f"candidate {stage}",
                               hint="the optimized model fails where the original runs: run "
                                    "fxopt.optimize(model, inputs, passes=[...]) with one pass at "
                                    "a time to find the pass that broke it") from exc


# ---------------------------------------------------------------------------------------------
# Comparing


def _compare_records(ref: _Record, cand: _Record, tols: dict, check_grads: bool,
                     check_eval: bool) -> VerifyReport:
    mismatches: list[Mismatch] = []
    checked: dict[str, int] = {}
    checked["output"] = _compare_trees("output", ref.outputs, cand.outputs, tols, mismatches)
    if check_grads:
        checked["input_grad"] = _compare_named("input_grad", ref.input_grads, cand.input_grads,
                                               tols, mismatches)
        checked["param_grad"] = _compare_named("param_grad", ref.param_grads, cand.param_grads,
                                               tols, mismatches)
    checked["buffer"] = _compare_named("buffer", ref.buffers, cand.buffers, tols, mismatches)
    if check_eval:
        checked["eval_output"] = _compare_trees("eval_output", ref.eval_outputs, cand.eval_outputs,
                                                tols, mismatches)
    return VerifyReport(ok=not mismatches, mismatches=mismatches, checked=checked)


def _structure(name: str, detail: str) -> Mismatch:
    return Mismatch("structure", name, math.inf, math.inf, 0.0, 0.0, detail)


def _container_types(spec: TreeSpec) -> Iterator[str]:
    if not spec.is_leaf():
        yield spec.type.__qualname__
        for child in spec.children():
            yield from _container_types(child)


def _sketch(spec: TreeSpec) -> str:
    if spec.is_leaf():
        return "*"
    return f"{spec.type.__name__}({', '.join(_sketch(c) for c in spec.children())})"


def _compare_trees(kind: str, ref: Any, cand: Any, tols: dict, mismatches: list[Mismatch]) -> int:
    """Compare two output pytrees leaf by leaf; leaves are named ``output[0]['logits']``."""
    ref_spec, cand_spec = tree_structure(ref), tree_structure(cand)
    if Counter(_container_types(ref_spec)) != Counter(_container_types(cand_spec)):
        sketches = f"{_sketch(ref_spec)[:80]} vs {_sketch(cand_spec)[:80]}"
        mismatches.append(_structure("output", f"{kind} containers differ: {sketches}"))
    named = [{f"output{keystr(path)}": leaf for path, leaf in tree_flatten_with_path(tree)[0]}
             for tree in (ref, cand)]
    return _compare_named(kind, *named, tols, mismatches)


def _compare_named(kind: str, ref: dict[str, Any], cand: dict[str, Any], tols: dict,
                   mismatches: list[Mismatch]) -> int:
    for name in (n for n in ref if n not in cand):
        mismatches.append(_structure(name, f"{kind} missing in candidate"))
    for name in (n for n in cand if n not in ref):
        mismatches.append(_structure(name, f"{kind} only in candidate (not in reference)"))
    common = [name for name in ref if name in cand]
    scale = _largest_magnitude([*ref.values(), *cand.values()])
    for name in common:
        found = _compare_value(kind, name, ref[name], cand[name], tols, scale)
        if found is not None:
            mismatches.append(found)
    return len(common)


def _largest_magnitude(values: list[Any]) -> float:
    """The largest finite magnitude among the floating tensors in ``values`` (0 if none)."""
    largest = 0.0
    for t in values:
        if (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
                and t.numel() and t.device.type != "meta"):
            magnitudes = t.detach().abs().to(torch.float64)
            largest = max(largest, float(torch.where(torch.isfinite(magnitudes), magnitudes,
                                                     0.0).max()))
    return largest


def _compare_value(kind: str, name: str, ref: Any, cand: Any, tols: dict,
                   scale: float) -> Mismatch | None:
    ref_is_tensor, cand_is_tensor = isinstance(ref, torch.Tensor), isinstance(cand, torch.Tensor)
    if ref_is_tensor and cand_is_tensor:
        return _compare_tensors(kind, name, ref, cand, tols, scale)
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
                     tols: dict, scale: float) -> Mismatch | None:
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
    if ref.numel() == 0:
        return None
    exact = not (ref.is_floating_point() or ref.is_complex())
    wide = torch.complex128 if ref.is_complex() else torch.float64
    b, a = ref.to(wide).reshape(-1), cand.to(wide).reshape(-1)
    shape = tuple(ref.shape)

    nan_ref, nan_cand = torch.isnan(b), torch.isnan(a)
    if nan_ref.any():
        i = _first(nan_ref)
        also = " (and in candidate)" if bool(nan_cand[i]) else ""
        return mismatch(f"NaN in reference at index {_position(i, shape)}{also}",
                        rtol=rtol, atol=atol)
    if nan_cand.any():
        return mismatch(f"NaN in candidate at index {_position(_first(nan_cand), shape)}",
                        rtol=rtol, atol=atol)
    infinite = torch.isinf(a) | torch.isinf(b)
    bad_inf = infinite & (a != b)
    if bad_inf.any():
        i = _first(bad_inf)
        return mismatch(f"inf must match exactly; at index {_position(i, shape)}: reference "
                        f"{_fmt(b[i])} vs candidate {_fmt(a[i])}", rtol=rtol, atol=atol)

    finite = ~infinite
    diff = torch.where(finite, (a - b).abs(), 0.0)
    magnitude = b.abs()
    nonzero = finite & (magnitude > 0)
    max_abs = float(diff.max())
    max_rel = float(torch.where(nonzero, diff / torch.where(nonzero, magnitude, 1.0), 0.0).max())
    if exact:
        outside = ref.reshape(-1) != cand.reshape(-1)
        if not outside.any():
            return None
        i = _first(outside)
        return mismatch(f"{int(outside.sum())} of {b.numel()} elements differ (exact match "
                        f"required for {ref.dtype}); first at index {_position(i, shape)}: "
                        f"reference {_fmt(b[i])} vs candidate {_fmt(a[i])}", max_abs, max_rel)
    atol = atol * min(1.0, scale)
    excess = torch.where(finite, diff - (atol + rtol * magnitude), -math.inf)
    outside = excess > 0
    if not outside.any():
        return None
    i = int(excess.argmax())
    return mismatch(f"{int(outside.sum())} of {b.numel()} elements outside tolerance; worst at "
                    f"index {_position(i, shape)}: reference {_fmt(b[i])} vs candidate "
                    f"{_fmt(a[i])}",
                    max_abs, max_rel, rtol, atol)


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


def _equivalence_error(report: VerifyReport) -> EquivalenceError:
    worst = report.worst()[0]
    error = EquivalenceError(
        f"the optimized model differs from the original: {len(report.mismatches)} tensor(s) differ;"
        f" worst: {worst.kind} {worst.name!r} (max abs diff {worst.max_abs_diff:.3g}, max rel diff "
        f"{worst.max_rel_diff:.3g}, rtol {worst.rtol:g}, atol {worst.atol:g}): {worst.detail}\n"
        f"{report}",
        where=", ".join(f"{m.kind} {m.name}" for m in report.worst()[:5]),
        hint="run fxopt.optimize(model, inputs, passes=[...]) with one pass at a time to bisect "
             "the pass that changed it; fxopt.verify(model, optimized, inputs) without strict=True "
             "returns the full report")
    error.report = report
    return error
