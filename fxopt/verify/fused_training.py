"""Prove that an optimizer step fused into backward trains as the ordinary one does:
``verify_fused_training`` (``fxopt.verify_fused_training``). Fusing itself is
``fxopt.runtime.fuse.fuse_optimizer`` (``fxopt.fuse_optimizer``).

``verify_fused_training`` runs ``steps`` training steps both ways from identical state and RNG
and compares parameters, buffers, optimizer state and learning rates after every step; with
``measure_memory=True`` it also measures each step's whole peak both ways (see its docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.core.errors import ConfigError, EquivalenceError, InputError
from fxopt.core.inputs import bind_keywords, refuse_meta_tensors
from fxopt.core.state import preserved_state
from fxopt.core.step import COTANGENT_SEED, as_args, training_step
from fxopt.core.tensors import storage_bytes, tensors_in
from fxopt.core.trees import map_tensors
from fxopt.runtime.fuse import OptimizerSpec, build_optimizer, fuse_optimizer
from fxopt.runtime.fused_step import DEFAULT_BUCKET_BYTES, DEFAULT_STEP_SLICE_BYTES, paused
from fxopt.verify.tensor_diff import Mismatch, compare_named, merged_tolerances


@dataclass
class FusedTrainingReport:
    """``verify_fused_training``'s result. ``mismatches``: (step, Mismatch) pairs, steps from 1;
    ``bit_identical``: every compared tensor equal to the last bit. When memory was measured,
    ``peaks`` holds per step the whole measured peak in bytes (ordinary, fused), and
    ``baselines`` what was alive when that step started (parameters, buffers, inputs, optimizer
    state, gradients), so ``peak - baseline`` is what the step itself added."""

    ok: bool
    steps: int
    optimizer: str
    checked: dict[str, int]
    mismatches: list[tuple[int, Mismatch]]
    bit_identical: bool
    peaks: list[tuple[int, int]] = field(default_factory=list)
    baselines: list[tuple[int, int]] = field(default_factory=list)

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {kind}" for kind, n in self.checked.items())
        lines = []
        if self.ok:
            how = "bit-identical" if self.bit_identical else "within tolerance"
            lines.append(f"fused {self.optimizer} trains like the ordinary one: {self.steps} "
                         f"steps, {counts} compared after each, {how}")
        else:
            lines.append(f"fused {self.optimizer} does NOT train like the ordinary one: "
                         f"{len(self.mismatches)} mismatch(es) over {self.steps} steps")
            for step, m in self.mismatches[:10]:
                lines.append(f"  step {step}: {m.kind} {m.name} max abs {m.max_abs_diff:.3g} "
                             f"rel {m.max_rel_diff:.3g}: {m.detail}")
        for step, ((plain, fused), (base, _)) in enumerate(zip(self.peaks, self.baselines), 1):
            lines.append(f"  step {step} whole peak: ordinary {plain / 2**20:.1f} MiB, fused "
                         f"{fused / 2**20:.1f} MiB ({plain / max(fused, 1):.2f}x); above the "
                         f"{base / 2**20:.1f} MiB alive at its start: {(plain - base) / 2**20:.1f}"
                         f" vs {(fused - base) / 2**20:.1f} MiB")
        return "\n".join(lines)


def verify_fused_training(model: nn.Module, optimizer: OptimizerSpec, example_inputs: Any, *,
                          steps: int = 3, candidate: nn.Module | None = None,
                          accumulation_steps: int = 1, clip_grad_value: float | None = None,
                          bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                          step_slice_bytes: int = DEFAULT_STEP_SLICE_BYTES,
                          scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                          seed: int = 0, tolerances: dict | None = None,
                          measure_memory: bool = False, strict: bool = False,
                          example_kwargs: dict[str, Any] | None = None,
                          **optimizer_kwargs: Any) -> FusedTrainingReport:
    """Train ``model`` ``steps`` steps with the ordinary optimizer, then ``candidate`` (default
    ``model``; fxopt's GraphModule of it shares its parameters) with the fused one, from the same
    parameters, buffers and RNG, and compare after every step.

    A step is ``accumulation_steps`` forward+backward passes on ``example_inputs`` (fxopt's
    training step: deterministic random cotangents, a different seed each step), then
    ``clip_grad_value_`` if asked, ``optimizer.step()``, ``zero_grad()`` and ``scheduler.step()``
    (``scheduler``: a factory over the optimizer) in the ordinary loop; the same passes then
    ``fused.step()``, ``zero_grad()`` and ``scheduler.step()`` in the fused one
    (``accumulation_steps``, ``clip_grad_value``, ``bucket_bytes`` and ``step_slice_bytes`` as
    ``fuse_optimizer`` takes them). Compared: every
    parameter and buffer, every optimizer state tensor and value (by parameter name), and each
    group's hyperparameters (a scheduler's lr). Float tensors pass within ``tolerances`` (fxopt's
    defaults); ``bit_identical`` says whether no tolerance was needed. ``strict=True`` raises
    ``EquivalenceError`` on a mismatch. The models are left as they were (parameters too).

    ``measure_memory=True`` tracks every tensor storage during each step (forward, backward,
    optimizer step, zero_grad; ``fxopt.analysis.memtrack``, exact on CPU) on top of what is alive
    when the step starts: parameters, buffers, inputs, optimizer state (Adam's moments exist from
    step 2 on: compare steps >= 2) and any gradient. ``peaks`` holds each step's whole peak both
    ways.
    """
    if steps < 1:
        raise ConfigError(f"verify_fused_training: steps={steps!r}", hint="pass an int >= 1")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise InputError("verify_fused_training needs to build the optimizer twice",
                         hint="pass its class and arguments, or a factory over parameters")
    candidate = model if candidate is None else candidate
    args = as_args(example_inputs)
    if example_kwargs:
        args = bind_keywords(model, args, example_kwargs)
    refuse_meta_tensors("verify_fused_training", model, args)
    canonical = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    runs = []
    for fused in (False, True):
        module = candidate if fused else model
        fuse = {"accumulation_steps": accumulation_steps, "clip_grad_value": clip_grad_value,
                "bucket_bytes": bucket_bytes, "step_slice_bytes": step_slice_bytes}
        runs.append(_train(module, (model, candidate), optimizer, optimizer_kwargs, args, fused,
                           steps, fuse, scheduler, seed, measure_memory, canonical))
    tols = merged_tolerances(tolerances)
    mismatches: list[tuple[int, Mismatch]] = []
    checked: dict[str, int] = {}
    identical = True
    for step, (ref, cand) in enumerate(zip(*(records for records, _ in runs)), 1):
        found: list[Mismatch] = []
        for kind in ref:
            checked[kind] = compare_named(kind, ref[kind], cand[kind], tols, found)
            identical &= all(_equal(ref[kind][n], cand[kind].get(n)) for n in ref[kind])
        mismatches += [(step, m) for m in found]
    name = _optimizer_name(optimizer)
    report = FusedTrainingReport(
        ok=not mismatches, steps=steps, optimizer=name, checked=checked, mismatches=mismatches,
        bit_identical=identical and not mismatches,
        peaks=[(a[1], b[1]) for a, b in zip(runs[0][1], runs[1][1])],
        baselines=[(a[0], b[0]) for a, b in zip(runs[0][1], runs[1][1])])
    if strict and not report.ok:
        step, worst = mismatches[0]
        raise EquivalenceError(
            f"fused {name} trains differently from the ordinary one: first at step {step}, "
            f"{worst.kind} {worst.name} (max abs diff {worst.max_abs_diff:.3g})\n{report}",
            where=f"step {step}, {worst.kind} {worst.name}",
            hint="an optimizer whose step reads other parameters' gradients cannot be fused; "
                 "otherwise report it as an fxopt bug")
    return report


def _optimizer_name(optimizer: OptimizerSpec) -> str:
    return getattr(optimizer, "__name__", type(optimizer).__name__)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _seed(seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def _parameters(*modules: nn.Module) -> list[torch.Tensor]:
    return [p for module in modules for p in module.parameters()]


def _train(module: nn.Module, both: tuple[nn.Module, nn.Module], optimizer: OptimizerSpec,
           kwargs: dict, args: tuple, fused: bool, steps: int, fuse: dict[str, Any],
           scheduler: Callable | None, seed: int, measure_memory: bool,
           canonical: dict[int, str]
           ) -> tuple[list[dict], list[tuple[int, int]]]:
    """One arm: the records after each step, and each step's (baseline, whole peak) in bytes
    when measured."""
    records: list[dict] = []
    peaks: list[tuple[int, int]] = []
    # paused(): a fused optimizer the user already has on these parameters stays out of it
    with paused(_parameters(*both)), preserved_state(*both), _parameters_restored(*both), \
            torch.enable_grad():
        for m in both:
            for p in m.parameters():
                p.grad = None
        _seed(seed)
        module.train()
        accumulation_steps, clip_grad_value = fuse["accumulation_steps"], fuse["clip_grad_value"]
        if fused:
            opt = fuse_optimizer(module, optimizer, **fuse, **kwargs)
        else:
            opt = build_optimizer(module, optimizer, kwargs)
        sched = scheduler(opt) if scheduler is not None else None
        try:
            for step in range(steps):
                def one_step() -> None:
                    for micro in range(accumulation_steps):
                        inputs = map_tensors(lambda t: t.detach().clone(), args)
                        training_step(module, inputs, seed=COTANGENT_SEED + 97 * step + micro)
                    if clip_grad_value is not None and not fused:
                        torch.nn.utils.clip_grad_value_(module.parameters(), clip_grad_value)
                    opt.step()
                    opt.zero_grad()

                if measure_memory:
                    alive = (list(module.parameters()), list(module.buffers()), args,
                             [p.grad for p in module.parameters()], _state_tensors(opt))
                    tracker = LiveStorageTracker()
                    with tracker:
                        one_step()
                    baseline = storage_bytes(alive)
                    peaks.append((baseline, baseline + tracker.peak_bytes))
                else:
                    one_step()
                if sched is not None:
                    sched.step()
                records.append(_snapshot(module, opt, canonical))
        finally:
            if fused:
                opt.remove()
    return records, peaks


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return tensors_in([dict(s) for s in opt.state.values()])


def _snapshot(module: nn.Module, opt: torch.optim.Optimizer,
              canonical: dict[int, str]) -> dict[str, dict[str, Any]]:
    def name(t: torch.Tensor, own: str) -> str:
        return canonical.get(id(t), own)

    params = {name(p, n): p.detach().clone() for n, p in module.named_parameters()}
    buffers = {name(b, n): b.detach().clone() for n, b in module.named_buffers()}
    names = {id(p): name(p, n) for n, p in module.named_parameters()}
    state: dict[str, Any] = {}
    for p, entries in opt.state.items():
        for key, value in entries.items():
            where = f"{names.get(id(p), f'parameter of shape {tuple(p.shape)}')}.{key}"
            state[where] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    groups = {f"param_groups[{i}].{key}": value for i, group in enumerate(opt.param_groups)
              for key, value in group.items() if key != "params"}
    return {"parameter": params, "buffer": buffers, "optimizer_state": state,
            "hyperparameter": groups}


class _parameters_restored:
    """Put every parameter's value back on exit (``preserved_state`` restores gradients, buffers
    and flags, not values an optimizer changed)."""

    def __init__(self, *modules: nn.Module):
        self.params = list({id(p): p for m in modules for p in m.parameters()}.values())

    def __enter__(self) -> None:
        self.values = [p.detach().clone() for p in self.params]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for p, value in zip(self.params, self.values):
                p.copy_(value)
