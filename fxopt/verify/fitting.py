"""Verification that fits where the user's model does not: where ``optimize`` runs its proof.

``fxopt.verify`` runs one training step of the *original* model, the one fxopt exists to shrink.
At the example size that step may not fit the device (the reason the user called ``optimize``).
``verify_where_it_fits`` runs the same proof, on the same graph, where it fits:

- ``"full"``: at the example size, on the model's device (the proof as it always was);
- ``"reduced"``: on the first rows of the example inputs (every tensor whose leading dimension
  is the example's batch size is cut to ``batch`` rows: the same data, a smaller batch), on the
  model's device. The optimized module serves other batch sizes (a graph captured with a
  dynamic batch, or symbolic tracing), so this checks the very code that will train; a module
  that cannot take a smaller batch says so (its input guard), and the CPU is tried instead, at
  once for a module captured with ``dynamic=False`` (no reference step is spent on a batch its
  guard refuses);
- ``"cpu"``: at the example size, on copies of both models on the CPU (they share their
  parameters, as the originals do), for a model whose smallest batch does not fit either.

``mode="auto"`` (``fxopt.optimize``'s default) verifies at full size where it fits: on the CPU
always; on a GPU when the original's predicted step (``estimate_peak``) fits the free device
memory with ``HEADROOM`` to spare (verification holds both models' records too). Otherwise it
takes the largest batch whose predicted step fits (halving from the example's), and the CPU when
even one row does not. An out-of-memory error at full size retries reduced. The result says
which was used (``Verified.where``), and ``optimize``'s report prints it.

A smaller batch proves the function on other data: a rewrite that is wrong only at the
example's batch size (a size baked into the graph) is missed there, and caught by the full-size
check wherever that fits. Everything a rewrite does to every row (each pass's edits) is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxopt.analysis.estimate import estimate_train_peak, resized_inputs
from fxopt.core.errors import ConfigError, EquivalenceError, FxoptError, InputError
from fxopt.core.tensors import format_bytes, module_device, storage_bytes, tensors_in
from fxopt.core.torch_private import tree_map_only
from fxopt.core.training_setup import TrainingSetup
from fxopt.runtime.input_guard import captured_static
from fxopt.verify.device_copies import copies_on
from fxopt.verify.equivalence import VerifyReport, verify

MODES = ("auto", "full", "reduced", "cpu")
HEADROOM = 1.5  # free memory needed, as a multiple of the original's predicted step
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Verified:
    """A verification and where it ran, in words (``"batch 4 of 32 on cuda:0"``)."""

    report: VerifyReport
    where: str


def check_mode(mode: Any) -> str:
    """``verify=`` as ``optimize`` takes it: True is ``"auto"``; a ``ConfigError`` otherwise."""
    if mode is True:
        return "auto"
    if mode not in MODES:
        raise ConfigError(f"verify={mode!r} is not one of True, False, {', '.join(map(repr, MODES))}",
                          hint="verify=True (or 'auto') proves the rewrite where it fits; 'full' "
                               "at the example size, 'reduced' at a smaller batch, 'cpu' on the CPU")
    return mode


def example_batch(args: tuple) -> int | None:
    """The example's batch size: the leading size of its first tensor with a dimension."""
    return next((t.shape[0] for t in tensors_in(args) if t.dim()), None)


def first_rows(args: tuple, batch: int, rows: int) -> tuple:
    """``args`` with every tensor whose leading dimension is ``batch`` cut to its first ``rows``."""
    return tree_map_only(torch.Tensor,
                         lambda t: t[:rows] if t.dim() and t.shape[0] == batch else t, args)


def _step_bytes(module: nn.Module, args: tuple, training: TrainingSetup) -> int:
    """What the original's training step adds on the device above what is already there
    (parameters and buffers are resident; inputs are cloned by verification); 0 when it
    cannot be predicted (the full-size proof is then tried, and an out-of-memory error at it
    retries smaller)."""
    try:
        peak = estimate_train_peak(module, args, training=training).bytes
    except FxoptError:
        return 0
    resident = storage_bytes((list(module.parameters()), list(module.buffers())))
    return max(peak - resident, 0)


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None  # host memory: the proof runs at full size
    free, _total = torch.cuda.mem_get_info(device)
    return free


def _fitting_batch(module: nn.Module, args: tuple, batch: int, training: TrainingSetup,
                   free: int | None, predict: Callable[[nn.Module, tuple], int]) -> int | None:
    """The largest batch, halving from ``batch // 2``, whose predicted step fits ``free``
    (``batch // 2`` when nothing is known to be short); None when even one row does not."""
    rows = max(batch // 2, 1)
    while True:
        if free is None or predict(module, resized_inputs(args, rows)) * HEADROOM <= free:
            return rows
        if rows == 1:
            return None
        rows //= 2


def verify_where_it_fits(model: nn.Module, optimized: nn.Module, args: tuple, *,
                         mode: str = "auto", training: TrainingSetup | None = None,
                         free_bytes: Callable[[torch.device], int | None] = _free_bytes,
                         predict: Callable[[nn.Module, tuple], int] | None = None,
                         **options: Any) -> Verified:
    """Run ``fxopt.verify(model, optimized, ...)`` where it fits (module docstring); ``options``
    go to ``verify`` (``strict=True`` raises ``EquivalenceError`` on a difference).
    ``free_bytes`` and ``predict`` are the device's free memory and the original's predicted
    step (what a test replaces to stand for a device that is short)."""
    training = training or TrainingSetup()
    predict = predict or (lambda module, inputs: _step_bytes(module, inputs, training))
    device = module_device(model, args)
    batch = example_batch(args)
    mode = check_mode(mode)
    if mode == "auto":
        free = free_bytes(device)
        fits = free is None or predict(model, args) * HEADROOM <= free
        if fits:
            try:
                return Verified(verify(model, optimized, args, **options), f"full size on {device}")
            except InputError as error:
                if not isinstance(error.__cause__, torch.OutOfMemoryError):
                    raise
                torch.cuda.empty_cache()
                why = "the original's step ran out of memory at full size"
        else:
            why = (f"the original's step is predicted at {format_bytes(predict(model, args))}, "
                   f"{format_bytes(free)} free on {device}")
        return _reduced(model, optimized, args, batch, training, free_bytes(device), predict,
                        why, options)
    if mode == "full":
        return Verified(verify(model, optimized, args, **options), f"full size on {device}")
    if mode == "reduced":
        return _reduced(model, optimized, args, batch, training, free_bytes(device), predict,
                        "asked for (verify='reduced')", options)
    return _on_cpu(model, optimized, args, "asked for (verify='cpu')", options)


def _reduced(model: nn.Module, optimized: nn.Module, args: tuple, batch: int | None,
             training: TrainingSetup, free: int | None,
             predict: Callable[[nn.Module, tuple], int], why: str,
             options: dict[str, Any]) -> Verified:
    device = module_device(model, args)
    if captured_static(optimized):
        return _on_cpu(model, optimized, args, f"{why}; the module serves the example's sizes "
                       "only (captured with dynamic=False)", options)
    rows = _fitting_batch(model, args, batch, training, free, predict) if batch else None
    if rows is None or rows >= (batch or 0):
        return _on_cpu(model, optimized, args, f"{why}; no smaller batch "
                       + ("fits" if batch and batch > 1 else "exists"), options)
    small = first_rows(args, batch, rows)
    try:
        report = verify(model, optimized, small, **options)
    except EquivalenceError as error:
        error.inputs = small  # what the proof ran on, for whoever looks into it (blame)
        raise
    except InputError as error:  # a module that does not take this batch (the model's own
        # code, or the optimized module's input guard): the proof goes to the CPU instead
        return _on_cpu(model, optimized, args, f"{why}; batch {rows} was refused: {error.what}",
                       options)
    return Verified(report, f"batch {rows} of {batch} on {device} ({why})")


def _on_cpu(model: nn.Module, optimized: nn.Module, args: tuple, why: str,
            options: dict[str, Any]) -> Verified:
    """The proof at full size on CPU copies of both models (sharing what the originals share)."""
    device = module_device(model, args)
    if device.type == "cpu":
        return Verified(verify(model, optimized, args, **options), f"full size on {device}")
    try:
        model_copy, optimized_copy = copies_on(CPU, model, optimized)
    except (RuntimeError, TypeError, FxoptError) as error:
        reason = error.what if isinstance(error, FxoptError) else f"{type(error).__name__}: {error}"
        raise InputError(
            f"the rewrite could not be verified: {why}, and the models cannot be copied to the "
            f"CPU ({reason})", where="fxopt.optimize verification",
            hint="free device memory or lower the example batch, or pass verify=False and check "
                 "with fxopt.verify on a machine where the original fits") from error
    cpu_args = tree_map_only(torch.Tensor, lambda t: t.to(CPU), args)
    try:
        report = verify(model_copy, optimized_copy, cpu_args, **options)
    except EquivalenceError as error:
        error.inputs = None  # on copies: a blame of the device models would not rerun this
        raise
    return Verified(report, f"full size on the CPU ({why})")
