"""Measured peak memory of one training step and of one inference forward.

Measured, not estimated. On CPU the figure is exact: ``LiveStorageTracker`` counts every tensor
storage allocated during the step (views and in-place results are not allocations) on top of the
baseline of parameters, buffers and inputs. On CUDA it is the caching allocator's
``max_memory_allocated`` over the step, from the ``memory_allocated`` before it (the baseline);
there the split of the peak into gradients and activations is not known and is reported as 0
gradients, and allocator rounding (512-byte blocks) is included.

A training step is ``fxopt.core.step.training_step`` with every ``.grad`` cleared first (like
``optimizer.zero_grad(set_to_none=True)``): backward from the model's own loss when its output
carries one (``loss.backward()``), else from every differentiable output with random cotangents
(``MemoryFigure.backward_from`` says which); inference is one forward in eval mode under
``torch.no_grad()``. Both run under ``preserved_state``: the module's grads, buffers (BatchNorm
statistics), training flags and the RNG are exactly as before afterwards.

A module that runs ``torch.compile``d code (``torch.compile(model)``, or ``block.compile()`` on
any of its submodules; ``fxopt.core.torch_private.compiled_modules``) cannot be measured by
storage tracking: with a dispatch mode active dynamo runs the eager code, so the figure would be
the eager model's. Such a module runs once to compile, and the second run is measured at
allocator level (``fxopt.measure.allocations``): on CPU the allocator's events as torch.profiler
records them (a few kilobytes of kernel scratch buffers more than storage tracking sees), on CUDA
the caching allocator. ``MemoryFigure.method`` says so, and gradients are not told apart from
activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from fxopt.analysis.estimate import gradients_released, released_gradients
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.core.errors import InputError
from fxopt.core.inputs import bind_keywords, refuse_meta_tensors
from fxopt.core.state import preserved_state
from fxopt.core.step import FROM_LOSS, as_args, describe_step, training_step
from fxopt.core.tensors import format_bytes, module_device, storage_bytes
from fxopt.core.torch_private import compiled_modules, uncompiled
from fxopt.core.training_setup import TrainingSetup
from fxopt.runtime.fused_step import fused_parameters
from fxopt.measure.allocations import cuda_peak_during, peak_allocated_during


CUDA_METHOD = "CUDA caching allocator"
TRACKED_METHOD = "live-storage tracking (exact)"
CPU_ALLOCATOR_METHOD = "CPU allocator (torch.profiler memory events)"


@dataclass(frozen=True)
class MemoryFigure:
    mode: str                       # "train" | "inference"
    device: str
    method: str
    peak_bytes: int                 # live tensor bytes at the peak, baseline included
    baseline_bytes: int             # params + buffers + inputs, alive before the step
    params_bytes: int
    buffers_bytes: int
    inputs_bytes: int
    grads_at_peak_bytes: int        # parameter/input gradients live at the peak
    activations_at_peak_bytes: int  # the rest of what the step added at the peak
    backward_from: str = ""         # train: what backward started from (core.step.describe_step)

    @property
    def step_peak_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_peak_bytes": self.step_peak_bytes}

    def format(self) -> str:
        """One readable line: ``train peak 36.2 MiB = baseline 858.8 KiB (parameters ...,
        buffers ..., inputs ...) + step 35.4 MiB (gradients ..., activations ...)``."""
        split = ("gradients and activations not told apart by the allocator"
                 if self.method != TRACKED_METHOD else
                 f"gradients {format_bytes(self.grads_at_peak_bytes)}, activations "
                 f"{format_bytes(self.activations_at_peak_bytes)}")
        return (f"{self.mode} peak {format_bytes(self.peak_bytes)} = baseline "
                f"{format_bytes(self.baseline_bytes)} (parameters "
                f"{format_bytes(self.params_bytes)}, buffers {format_bytes(self.buffers_bytes)}, "
                f"inputs {format_bytes(self.inputs_bytes)}) + step "
                f"{format_bytes(self.step_peak_bytes)} ({split})")

    def __str__(self) -> str:
        return self.format()


@dataclass(frozen=True)
class MemoryReport:
    """What ``measure`` returns: the training-step figure and the inference figure.
    ``str(report)`` (or ``report.format()``) is a readable summary; the fields hold bytes."""

    train: MemoryFigure
    inference: MemoryFigure

    def as_dict(self) -> dict[str, Any]:
        return {"train": self.train.as_dict(), "inference": self.inference.as_dict()}

    def format(self) -> str:
        """Three lines: where and how it was measured (and, for a model returning its loss, that
        the training step backpropagated it), then the training and inference peaks."""
        loss = (f"; training step: backward from {FROM_LOSS}"
                if self.train.backward_from == FROM_LOSS else "")
        return "\n".join([f"measured on {self.train.device} by {self.train.method}{loss}:",
                          "  " + self.train.format(), "  " + self.inference.format()])

    def __str__(self) -> str:
        return self.format()


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return str(device)


def _measure(module: nn.Module, example_inputs: Any, mode: str,
             example_kwargs: dict[str, Any] | None = None,
             training: TrainingSetup | None = None) -> MemoryFigure:
    inputs = as_args(example_inputs)
    if example_kwargs:
        inputs = bind_keywords(uncompiled(module), inputs, example_kwargs)
    refuse_meta_tensors("measure", module, inputs)
    device = module_device(module, inputs)
    compiled = compiled_modules(module)
    parameters, buffers = list(module.parameters()), list(module.buffers())
    # A storage shared by several kinds counts once, for the first of parameters, buffers, inputs.
    params_bytes = storage_bytes(parameters)
    buffers_bytes = storage_bytes((parameters, buffers)) - params_bytes
    baseline = storage_bytes((parameters, buffers, inputs))
    input_bytes = baseline - params_bytes - buffers_bytes
    with preserved_state(module):
        for p in module.parameters():
            p.grad = None
        if mode == "train":
            module.train()
        else:
            module.eval()

        described: list[str] = []

        def run() -> None:
            if mode == "train":
                with as_planned(module, training):
                    described.append(describe_step(training_step(module, inputs)))
            else:
                with torch.no_grad():
                    module(*inputs)

        if compiled:
            # Storage tracking would make dynamo run the eager code. The first call compiles (and
            # may allocate to do so); the second, the compiled code alone, is the one measured.
            run()
            for p in module.parameters():
                p.grad = None
            described.clear()
            step_peak = peak_allocated_during(run, device)
            grads_at_peak, method = 0, compiled_method(device, compiled)
        elif device.type == "cuda":
            step_peak = cuda_peak_during(run, device)
            grads_at_peak, method = 0, CUDA_METHOD
        else:
            tracker = LiveStorageTracker()
            with tracker:
                run()
            step_peak = tracker.peak_bytes
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            grads_at_peak = tracker.bytes_at_peak(grads)
            method = TRACKED_METHOD
    return MemoryFigure(
        mode=mode, device=_describe(device), method=method,
        peak_bytes=baseline + step_peak, baseline_bytes=baseline, params_bytes=params_bytes,
        buffers_bytes=buffers_bytes, inputs_bytes=input_bytes, grads_at_peak_bytes=grads_at_peak,
        activations_at_peak_bytes=step_peak - grads_at_peak,
        backward_from=described[-1] if described else "",
    )


def compiled_method(device: torch.device, compiled: list[str]) -> str:
    """How a module running ``torch.compile``d code (at the paths ``compiled``) is measured."""
    where = ", ".join(path or "the module itself" for path in compiled[:3])
    more = f" and {len(compiled) - 3} more" if len(compiled) > 3 else ""
    allocator = CUDA_METHOD if device.type == "cuda" else CPU_ALLOCATOR_METHOD
    return f"{allocator}, torch.compile'd code ({where}{more}) after one warm-up call"


def refuse_compiled(what: str, module: nn.Module) -> None:
    """Raise ``InputError`` when ``module`` runs ``torch.compile``d code: ``what`` follows the ops
    of one run, and under its dispatch mode dynamo runs the eager code instead of the compiled."""
    compiled = compiled_modules(module)
    if compiled:
        where = ", ".join(path or "the module itself" for path in compiled[:3])
        raise InputError(
            f"{what} cannot see inside torch.compile'd code: it records the ops of one run, and "
            "while it records them torch.compile runs the eager code instead, so its figures "
            "would be the uncompiled model's", where=f"{what}({type(module).__name__}): {where}",
            hint="pass the module as it was before torch.compile (or before .compile() on its "
                 "blocks); fxopt.measure(compiled, inputs) measures the compiled peaks")


@contextlib.contextmanager
def as_planned(module: nn.Module, training: TrainingSetup | None) -> Iterator[None]:
    """Inside: a real training step of ``module`` holds what the step ``training`` describes
    holds, without changing a weight: its autocast, and the gradients a fused optimizer step
    (paused inside fxopt's runs) or per-block FSDP2 would free dropped as soon as they are
    accumulated (the step's own temporaries are not run)."""
    if training is None:
        yield
        return
    names = released_gradients(module, training)
    fused = {id(p) for p in fused_parameters(module, training.fused_optimizer)}
    dropped = {id(p): p for name, p in module.named_parameters(remove_duplicate=False)
               if (name in names or id(p) in fused) and p.requires_grad}
    with gradients_released({str(i): p for i, p in dropped.items()},
                            frozenset(map(str, dropped))), training.precision():
        yield


def measure_train_step(module: nn.Module, example_inputs: Any,
                       example_kwargs: dict[str, Any] | None = None, *,
                       training: TrainingSetup | None = None) -> MemoryFigure:
    """Measured peak of one forward + backward (grads start as None); ``training``: measure the
    step as planned for it (``as_planned``: its autocast, and gradients a fused optimizer step or
    per-block sharding frees, dropped at accumulation)."""
    return _measure(module, example_inputs, "train", example_kwargs, training)


def measure_inference(module: nn.Module, example_inputs: Any,
                      example_kwargs: dict[str, Any] | None = None) -> MemoryFigure:
    """Measured peak of one eval-mode forward under ``torch.no_grad()``."""
    return _measure(module, example_inputs, "inference", example_kwargs)


def measure(module: nn.Module, example_inputs: Any,
            example_kwargs: dict[str, Any] | None = None) -> MemoryReport:
    """Measure the peak memory of one training step and of one inference forward of ``module``.

    ``example_inputs`` are forward's positional arguments (a tensor or a tuple), and
    ``example_kwargs`` its keyword ones, bound by name as ``fxopt.optimize`` binds them. The model
    runs for real, on the device its parameters and inputs are on: on CPU every tensor storage
    alive is counted (exact), on CUDA the caching allocator's peak is read. A module running
    ``torch.compile``d code (the whole model or some of its blocks) is measured as compiled, at
    allocator level after one warm-up run (see the module docstring); ``report.train.method``
    says so.

    Returns a ``MemoryReport`` with ``.train`` and ``.inference`` (``MemoryFigure``): figures in
    bytes (``peak_bytes`` is the whole step, parameters, buffers and inputs included;
    ``step_peak_bytes`` what the step added), and ``print(report)`` for a readable summary in
    KiB/MiB/GiB. The module's grads, buffers, training flags and the RNG are as before afterwards.

    Not handled: models on the meta device (an ``InputError``), several devices at once.

    Example::

        report = fxopt.measure(model, torch.randn(8, 3, 224, 224))
        print(report)              # "train peak 1.2 GiB = baseline ... + step ...", in MiB/GiB
        report.train.peak_bytes    # the same figure in bytes (an int)
    """
    return MemoryReport(measure_train_step(module, example_inputs, example_kwargs),
                        measure_inference(module, example_inputs, example_kwargs))
