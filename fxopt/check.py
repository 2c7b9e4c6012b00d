"""The CI equivalence gate: optimize once, then verify on several inputs and batch sizes.

``check_equivalence(model, example_inputs, ...)`` runs the pipeline once (without its own
verification) and then ``fxopt.verify`` -- outputs, input and parameter gradients, buffers after
the step, eval outputs -- on:

1. the example inputs, with RNG seed ``seeds[0]`` (``"inputs": "example"``);
2. for every batch size in ``batch_sizes`` (default: the example's) and every seed in ``seeds``,
   random inputs shaped like the example inputs with the batch dimension (dim 0) set to that
   size, drawn from ``torch.Generator().manual_seed(seed)`` (floats: standard normal; integers:
   uniform between the example's min and max, so token ids stay valid), with the RNG (dropout)
   seeded with ``seed`` for both models (``"inputs": "random"``).

An optimized model that crashes where the original runs is a mismatch of kind ``"error"``; an
original that crashes (e.g. BatchNorm in train mode at batch size 1) is an ``InputError``.

JSON schema ``fxopt.check/1`` (``CheckResult.as_dict()``; keys are only ever added)::

    {
      "schema": "fxopt.check/1",
      "ok": true,                      # every run matched
      "target": "zoo:mlp" | null,      # what the CLI was given
      "model": "Sequential",           # the model's class name
      "passes": [{"name": "inplace_activations", "modified": true}, ...],
      "runs": [
        {"batch_size": 8, "seed": 0, "inputs": "example" | "random", "ok": true,
         "checked": {"output": 1, "input_grad": 1, "param_grad": 8, "buffer": 0,
                     "eval_output": 1},             # tensors compared, per kind
         "mismatches": [
           {"kind": "output" | "input_grad" | "param_grad" | "buffer" | "eval_output" |
                    "structure" | "error",
            "name": "output", "max_abs": 0.31 | null, "max_rel": 0.02 | null,  # null: not a number
            "rtol": 0.0001, "atol": 0.0001, "detail": "3 of 80 elements outside tolerance; ..."}
         ]}
      ],
      "summary": {"runs": 3, "failed_runs": 0, "mismatches": 0},
      "error": null | {"type": "TraceError", "message": "..."}   # exit code 2 (set by the CLI)
    }
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxopt.api import optimize
from fxopt.core.errors import ConfigError, EquivalenceError
from fxopt.core.inputs import check_inputs
from fxopt.core.step import as_args
from fxopt.core.tensors import tensors_in
from fxopt.core.torch_private import tree_map_only
from fxopt.verify.equivalence import verify

SCHEMA = "fxopt.check/1"
Progress = Callable[[int, int, str], None]


@dataclass
class CheckRun:
    batch_size: int | None
    seed: int
    inputs: str                                  # "example" | "random"
    ok: bool
    checked: dict[str, int] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "seed": self.seed, "inputs": self.inputs,
                "ok": self.ok, "checked": dict(self.checked), "mismatches": list(self.mismatches)}

    def label(self) -> str:
        return f"batch {self.batch_size}, seed {self.seed} ({self.inputs} inputs)"


@dataclass
class CheckResult:
    model: str
    passes: list[dict[str, Any]]
    runs: list[CheckRun]
    target: str | None = None

    @property
    def ok(self) -> bool:
        return all(run.ok for run in self.runs)

    def as_dict(self) -> dict[str, Any]:
        failed = [run for run in self.runs if not run.ok]
        return {"schema": SCHEMA, "ok": self.ok, "target": self.target, "model": self.model,
                "passes": self.passes, "runs": [run.as_dict() for run in self.runs],
                "summary": {"runs": len(self.runs), "failed_runs": len(failed),
                            "mismatches": sum(len(run.mismatches) for run in self.runs)},
                "error": None}

    def __str__(self) -> str:
        passes = ", ".join(f"{p['name']} ({'changed' if p['modified'] else 'unchanged'})"
                           for p in self.passes) or "none"
        lines = [f"fxopt check {self.target or self.model}: passes {passes}"]
        for run in self.runs:
            counts = ", ".join(f"{n} {kind}" for kind, n in run.checked.items())
            lines.append(f"  {'ok      ' if run.ok else 'MISMATCH'}  {run.label():<36} {counts}")
            for m in run.mismatches[:5]:
                lines.append(f"            {m['kind']} {m['name']!r}: max abs {_num(m['max_abs'])}"
                             f", max rel {_num(m['max_rel'])}: {m['detail']}")
        failed = sum(not run.ok for run in self.runs)
        lines.append(f"  {'equivalent' if self.ok else 'NOT equivalent'}: "
                     f"{len(self.runs) - failed} of {len(self.runs)} runs match")
        return "\n".join(lines)

    def failure_message(self) -> str:
        """One pytest-friendly message naming the first tensor that differs, then the table."""
        first = next(run for run in self.runs if not run.ok)
        worst = first.mismatches[0]
        return (f"the optimized model differs from the original in "
                f"{sum(not r.ok for r in self.runs)} of {len(self.runs)} runs; first at "
                f"{first.label()}: {worst['kind']} {worst['name']!r} (max abs diff "
                f"{_num(worst['max_abs'])}, rtol {worst['rtol']}, atol {worst['atol']}): "
                f"{worst['detail']}\n{self}")


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def random_inputs_like(example_inputs: Any, *, seed: int, batch_size: int | None = None) -> tuple:
    """Random tensors shaped like the tensors in ``example_inputs`` (nested ones too), with the
    batch dimension (dim 0) set to ``batch_size``; other values are kept."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cpu = torch.device("cpu")  # drawn there whatever the default device, then moved: the same
    # numbers on every device

    def make(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        if batch_size is not None and shape:
            shape[0] = batch_size
        if t.is_floating_point() or t.is_complex():
            return torch.randn(shape, generator=gen, dtype=t.dtype, device=cpu).to(t.device)
        if t.dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen, device=cpu).bool().to(t.device)
        low, high = (int(t.min()), int(t.max()) + 1) if t.numel() else (0, 2)
        return torch.randint(low, high, shape, generator=gen, dtype=t.dtype,
                             device=cpu).to(t.device)

    return tree_map_only(torch.Tensor, make, as_args(example_inputs))


def _run(model: nn.Module, gm: fx.GraphModule, inputs: tuple, *, batch_size: int | None,
         seed: int, kind: str, tolerances: Any) -> CheckRun:
    try:
        report = verify(model, gm, inputs, seed=seed, tolerances=tolerances)
    except EquivalenceError as error:  # the optimized model crashed where the original runs
        return CheckRun(batch_size, seed, kind, False, {}, [{
            "kind": "error", "name": error.where or "candidate", "max_abs": None,
            "max_rel": None, "rtol": 0.0, "atol": 0.0, "detail": error.what}])
    mismatches = [{"kind": m["kind"], "name": m["name"], "max_abs": m["max_abs_diff"],
                   "max_rel": m["max_rel_diff"], "rtol": m["rtol"], "atol": m["atol"],
                   "detail": m["detail"]} for m in report.as_dict()["mismatches"]]
    return CheckRun(batch_size, seed, kind, report.ok, dict(report.checked), mismatches)


def check_equivalence(
    model: nn.Module,
    example_inputs: Any,
    *,
    passes: Any = None,
    memory_budget: int | float | str | None = None,
    seeds: Sequence[int] = (0, 1),
    batch_sizes: Sequence[int] | None = None,
    tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
    leaf_modules: tuple[str, ...] = (),
    progress: Progress | None = None,
    capture: str = "auto",
    example_kwargs: dict[str, Any] | None = None,
    fused_optimizer: Any = None,
    dynamic: bool = True,
) -> tuple[CheckResult, fx.GraphModule]:
    """Optimize ``model`` and verify it on several inputs; see the module docstring.
    ``capture`` is ``fxopt.optimize``'s capture frontend option, ``example_kwargs`` its keyword
    example inputs, ``fused_optimizer`` the fused optimizer step it plans for, ``dynamic`` its
    size option (with ``dynamic=False`` a torch.export capture serves the example's batch size
    only, so ``batch_sizes`` must be left out)."""
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        raise ConfigError(f"seeds must be a non-empty list of integers, got {seeds!r}",
                          hint="e.g. seeds=(0, 1, 2)")
    if batch_sizes is not None and (not batch_sizes or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes)):
        raise ConfigError(f"batch sizes must be positive integers, got {batch_sizes!r}",
                          hint="e.g. batch_sizes=(1, 4)")
    if batch_sizes is not None and dynamic is False:
        raise ConfigError(f"batch sizes {list(batch_sizes)} with dynamic=False: a module "
                          "captured at the example's sizes refuses any other batch size",
                          hint="leave batch_sizes out (CLI: --batch-sizes), or drop "
                               "dynamic=False (CLI: --static-shapes)")
    args = check_inputs(model, example_inputs, example_kwargs)
    gm = optimize(model, args, passes=passes, memory_budget=memory_budget, verify=False,
                  leaf_modules=leaf_modules, capture=capture, fused_optimizer=fused_optimizer,
                  dynamic=dynamic)
    first = next((t for t in tensors_in(args) if t.dim()), None)
    example_batch = int(first.shape[0]) if first is not None else None
    plan = [(example_batch, seeds[0], "example")]
    plan += [(b, s, "random") for b in (batch_sizes or [example_batch]) for s in seeds]
    runs = []
    for index, (batch, seed, kind) in enumerate(plan):
        if progress:
            progress(index, len(plan), f"batch {batch}, seed {seed}")
        inputs = args if kind == "example" else random_inputs_like(args, seed=seed,
                                                                   batch_size=batch)
        runs.append(_run(model, gm, inputs, batch_size=batch, seed=seed, kind=kind,
                         tolerances=tolerances))
    if progress:
        progress(len(plan), len(plan), "done")
    passes_done = [{"name": r.name, "modified": r.modified} for r in gm.fxopt_report.passes]
    return CheckResult(type(model).__name__, passes_done, runs), gm
