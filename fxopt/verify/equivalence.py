"""Prove a rewritten model computes the same function as the original: ``verify``.

``verify(reference, candidate, example_inputs)`` runs one training step of each model (train mode,
the same seed, the same starting state, the same cotangents from :mod:`fxopt.core.step`) and compares:

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
(:mod:`fxopt.verify.rounding`): if both models agree in float64 and the candidate's float32 results are
no less accurate than the original's, the differences are rounding (the order of a gradient
accumulation, amplified by an ill-conditioned BatchNorm) and are listed as ``rounding``, not as
mismatches. A candidate that cannot run in float64 (a graph captured by ``torch.export`` has its
dtypes built in) is judged against the float64 run of the original alone: its float32 error
against it must be within a few times the original float32 model's own.

Tolerances (``DEFAULT_TOLERANCES``, per dtype) and the element-wise comparison live in
:mod:`fxopt.verify.tensor_diff`. Never blessed: NaN anywhere (even NaN in both at the same place), infinities that differ, a dtype,
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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from fxopt.core.errors import EquivalenceError, FxoptError, InputError
from fxopt.core.inputs import bind_keywords, refuse_meta_tensors
from fxopt.core.state import preserved_state
from fxopt.core.step import as_args, backward_from
from fxopt.core.torch_private import (
    keystr,
    tree_flatten_with_path,
    tree_unflatten,
)
from fxopt.core.trees import map_tensors
from fxopt.verify.rounding import (
    ORIGINAL_ONLY,
    explainable_by_rounding,
    recheck_in_float64,
)
from fxopt.verify.tensor_diff import (
    DEFAULT_TOLERANCES,
    Mismatch,
    compare_named,
    compare_trees,
    merged_tolerances,
)

_TABLE_ROWS = 10


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
            finite = [m.max_rel_diff for m in self.rounding if math.isfinite(m.max_rel_diff)]
            worst = f" (up to {max(finite):.2g} relative)" if finite else " (at zeros)"
            how = (f"no less accurate than the original against its float64 run ({ORIGINAL_ONLY})"
                   if any(ORIGINAL_ONLY in m.detail for m in self.rounding)
                   else "equal in float64, and no less accurate than the original")
            return (f"equivalent: {counts} compared; {len(self.rounding)} float32 difference(s)"
                    f"{worst} are rounding: {how}")
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
    example_kwargs: dict[str, Any] | None = None,
) -> VerifyReport:
    """Compare one training step (and one eval forward) of ``candidate`` against ``reference``.

    ``tolerances`` overrides :data:`DEFAULT_TOLERANCES` per dtype. ``strict=True`` raises
    :class:`~fxopt.core.errors.EquivalenceError` (carrying the report as ``.report``) on any mismatch.
    ``recheck_float64``: when the only differences are finite numbers, decide in float64 whether
    they are rounding (see :mod:`fxopt.verify.rounding`); the report lists them under ``rounding``.
    ``example_kwargs``: keyword inputs, bound to forward's parameters as ``fxopt.optimize``
    binds them.
    """
    args = _checked_inputs(reference, candidate, example_inputs, example_kwargs)
    tols = merged_tolerances(tolerances)

    def record(model: nn.Module, both: tuple[nn.Module, nn.Module], inputs: tuple) -> _Record:
        """One model's record; shared tensors are named as the reference (``both[0]``) names
        them."""
        ref = both[0]
        canonical = {id(t): n for n, t in [*ref.named_parameters(), *ref.named_buffers()]}
        return _record(model, both, inputs, seed, check_grads, check_eval, canonical)

    both = (reference, candidate)
    records = [record(model, both, args) for model in both]
    report = _compare_records(*records, tols, check_grads, check_eval)
    if not report.ok and recheck_float64 and explainable_by_rounding(report.mismatches):
        equal, mismatches = recheck_in_float64(
            reference, candidate, args, records, report.mismatches, record,
            lambda ref, cand: _compare_records(ref, cand, tols, check_grads, check_eval))
        report = VerifyReport(ok=equal, mismatches=[] if equal else mismatches,
                              checked=report.checked, rounding=mismatches if equal else [])
    if strict and not report.ok:
        raise _equivalence_error(report)
    return report


def _checked_inputs(reference: Any, candidate: Any, example_inputs: Any,
                    example_kwargs: dict[str, Any] | None) -> tuple:
    for role, module in (("reference", reference), ("candidate", candidate)):
        if not isinstance(module, nn.Module):
            raise InputError(f"verify: the {role} is a {type(module).__name__}, "
                             "not a torch.nn.Module",
                             hint="pass the model objects themselves (nn.Module or fx.GraphModule)")
    args = as_args(example_inputs)
    if example_kwargs:
        args = bind_keywords(reference, args, example_kwargs)
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
    return map_tensors(lambda x: x.detach().clone(), tree)


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
    checked["output"] = compare_trees("output", ref.outputs, cand.outputs, tols, mismatches)
    if check_grads:
        checked["input_grad"] = compare_named("input_grad", ref.input_grads, cand.input_grads,
                                               tols, mismatches)
        checked["param_grad"] = compare_named("param_grad", ref.param_grads, cand.param_grads,
                                               tols, mismatches)
    checked["buffer"] = compare_named("buffer", ref.buffers, cand.buffers, tols, mismatches)
    if check_eval:
        checked["eval_output"] = compare_trees("eval_output", ref.eval_outputs, cand.eval_outputs,
                                                tols, mismatches)
    return VerifyReport(ok=not mismatches, mismatches=mismatches, checked=checked)


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
