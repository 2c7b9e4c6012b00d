"""Predicted peak memory of a training step and of inference, without real compute.

``estimate_peak(module, example_inputs)`` runs the module -- a GraphModule or any nn.Module -- on
fake tensors (``fxopt.graph.fake_run``: fake parameters that require grad as the real ones do, fake
buffers, fake inputs) under ``LiveStorageTracker``, the same tracker ``fxopt.measure`` counts real
CPU runs with. The training figure runs ``fxopt.core.step.training_step`` itself in train mode
(forward, then backward from what ``fxopt.core.step.step_loss`` picks: the model's own loss when
its output carries one, else every differentiable output with the same random cotangents; grads
starting as None; ``train_backward_from`` says which); the inference figure is one forward in
eval mode under ``torch.no_grad()``, as ``fxopt.measure`` does both; the module's own flags are
restored afterwards. Since a
GraphModule's generated code is executed, FX's rule of dropping each value after its last use is
followed as is.

Both figures count every live storage: parameters, buffers and inputs (``baseline_bytes``) plus
what the step allocates. Parameters whose optimizer step the user fused into backward
(``fused_optimizer=``, what ``fxopt.fuse_optimizer`` returned) are stepped on the fakes too, with
the optimizer's own kernels, and their gradients freed at the step
(``fxopt.analysis.fused_gradients``); the optimizer's state is reported beside the peaks
(``optimizer_state_bytes``), not in them. The real BatchNorm statistics, ``.grad``, training flags
and the RNG are left untouched.

Not handled: memory that kernels allocate internally without returning it as a tensor (invisible
to the dispatcher on CPU and on fakes alike), the CUDA allocator's caching and its rounding of
the baseline (counted as ``fxopt.core.tensors.storage_bytes``; what the step allocates is
rounded, see ``fxopt.analysis.memtrack``), and opaque leaves (``meta["fxopt_meta_source"] ==
"real"``) at other input sizes than the example inputs they were run on for real. Such a leaf
replays that real run on the fakes (``fxopt.graph.leaf_tape``): its ops allocate, save and free
as they did for real, so it is counted like any other node; where the replay cannot go through,
the figures measured inside it on the real run stand in (``fxopt.analysis.leaf_runs``).

``max_batch_size(model, example_inputs, budget_bytes)`` fits ``peak = a + b * batch`` from two
estimates, then confirms the answer with estimates at it and one above (bisecting if the fit is
off), all on fakes; it never runs out of memory on purpose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxopt.analysis.fused_gradients import (
    OPTIMIZER_STEP,
    FusedStepModel,
    fused_steps_on_fakes,
)
from fxopt.analysis.memtrack import (
    LiveStorageTracker,
    mark_handed_back,
    tag_live,
    tag_untagged_live,
)
from fxopt.analysis.prediction_memo import remembered
from fxopt.graph.fake_run import (
    on_fake_tensors,
    opaque_leaves_stood_in,
    training_flags,
)
from fxopt.analysis.blocks import block_parameter_names
from fxopt.core.errors import BudgetError, InputError
from fxopt.core.inputs import check_inputs
from fxopt.core.step import as_args, describe_step, training_step
from fxopt.core.tensors import storage_bytes, storage_key, tensors_in
from fxopt.core.torch_private import FakeTensorMode
from fxopt.core.training_setup import TrainingSetup
from fxopt.runtime.fused_step import FusedOptimizers


@dataclass(frozen=True)
class TrainPeak:
    """A training step's predicted peak in bytes of live tensor storage, and what it holds."""

    bytes: int
    baseline_bytes: int          # parameters + buffers + inputs, alive throughout
    grad_bytes: int              # parameter gradients alive at the peak
    op: str                      # the op whose result made the peak
    fused: FusedStepModel = FusedStepModel()  # the user's optimizer steps fused into backward
    optimizer_step_bytes: int = 0  # temporaries of a fused optimizer step alive at the peak
    backward_from: str = ""      # what backward started from (``fxopt.core.step.describe_step``)
    forward_bytes: int | None = None  # storages forward made and left alive, outputs aside
    #                                   (what it saved for backward), alive at the peak (and,
    #                                   predicted with ``watch_saved``, not taken back by
    #                                   backward before it); None for a step without backward

    @property
    def saved_values_at_peak(self) -> bool:
        """Whether values forward saved for backward are alive at the peak, still held for
        backward. When none are (the peak comes after backward has freed them or taken them
        back, or in forward among temporaries it never saves), recomputing a region in
        backward cannot lower it: that only drops saved values, and adds recomputed ones."""
        return self.forward_bytes is None or self.forward_bytes > 0

    @property
    def activation_bytes(self) -> int:
        """What checkpointing can act on: the peak minus the baseline, the parameter gradients
        and a fused optimizer step's temporaries alive at that moment (what remains: saved
        activations, their gradients, the backward's temporaries)."""
        return max(self.bytes - self.baseline_bytes - self.grad_bytes
                   - self.optimizer_step_bytes, 0)


@dataclass(frozen=True)
class PeakEstimate:
    """Predicted peaks in bytes of live tensor storage, and where they happen."""

    train_bytes: int
    inference_bytes: int
    baseline_bytes: int          # parameters + buffers + inputs, alive throughout
    train_peak_op: str           # the op whose result made the training peak
    inference_peak_op: str
    train_grad_bytes: int = 0    # parameter gradients alive at the training peak
    optimizer_state_bytes: int = 0  # state of the optimizers fused into backward (not in peaks)
    fused_parameters: int = 0    # parameters whose gradient is freed at their step in backward
    train_optimizer_step_bytes: int = 0  # a fused step's temporaries alive at the training peak
    train_backward_from: str = ""  # what the training step backpropagated: the model's loss
    #                                or random cotangents over its outputs (``describe_step``)

    @property
    def activation_bytes(self) -> int:
        """The training peak minus the baseline, and the gradients and fused optimizer step
        temporaries alive at it (``TrainPeak``)."""
        return max(self.train_bytes - self.baseline_bytes - self.train_grad_bytes
                   - self.train_optimizer_step_bytes, 0)


def _tracked(module: nn.Module, example_inputs: Any, step: Callable[[nn.Module, tuple], Any],
             training: TrainingSetup) -> TrainPeak:
    """The peak of ``step`` run on fakes under the tracker (``grad_bytes``: the parameter
    gradients the step left that were alive at the peak; 0 for a step without backward), in the
    precision ``training`` runs in. Parameters the user's fused optimizers step in backward are
    stepped there on the fakes too (``fxopt.analysis.fused_gradients``); under per-block
    sharding the gradients of the blocks' parameters are dropped once accumulated
    (``gradients_released``). Workspaces measured on the device (``training.device_memory``)
    are held while their op runs. Inside ``predictions_remembered`` (one ``optimize`` call), a
    prediction asked for again is answered from memory (``fxopt.analysis.prediction_memo``)."""
    return remembered(step.__name__, module, example_inputs, training,
                      lambda: _predicted(module, example_inputs, step, training),
                      also_answers=(_train.__name__,) if step is _train_watching_saved else ())


def _predicted(module: nn.Module, example_inputs: Any, step: Callable[[nn.Module, tuple], Any],
               training: TrainingSetup) -> TrainPeak:
    train = step in (_train, _train_watching_saved)
    real = dict(module.named_parameters(remove_duplicate=False)) if train else {}
    fused_optimizer = training.fused_optimizer if train else None
    released = released_gradients(module, training) if train else frozenset()
    with opaque_leaves_stood_in(module), on_fake_tensors(module, example_inputs) as run, \
            gradients_tagged(run.state.values()), \
            gradients_released(run.state, released), \
            fused_steps_on_fakes(module, real, run.state, fused_optimizer) as fused:
        for t in run.state.values():
            t.grad = None
        tracker = LiveStorageTracker(device_memory=training.device_memory)
        try:
            with tracker.observing(run.mode), training.precision():
                described = step(module, run.inputs)
        except InputError:  # an opaque leaf asked at sizes it was not run at says so itself
            raise
        except Exception as error:  # torch raises many types on fakes; one clear error instead
            raise InputError(
                f"{type(module).__name__} cannot run on fake tensors, so its peak cannot be "
                f"predicted: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                where=f"estimate_peak({type(module).__name__}), {step.__name__.strip('_')} step",
                hint="trace the model with fxopt.trace() first: parts that read tensor values "
                     "become leaf modules, which the estimate stands in for") from error
        baseline = storage_bytes((list(run.state.values()), run.inputs))
        tagged = tracker.bytes_by_tag_at_peak(lapsing=(FORWARD_VALUE,))
        return TrainPeak(baseline + tracker.peak_bytes, baseline, tagged.get(GRADIENT, 0),
                         tracker.peak_op, fused, tagged.get(OPTIMIZER_STEP, 0), described or "",
                         tagged.get(FORWARD_VALUE, 0) if train else None)


GRADIENT = "parameter gradient"  # the tracker's tag for an accumulated ``.grad``
OUTPUT, FORWARD_VALUE = "output", "forward value"  # what forward returned, and the rest it left


def _tag_what_forward_left(output: Any) -> None:
    """The storages alive when forward returns: its outputs, and the rest it made (the values
    autograd saved for backward, mostly); a storage that forward freed has no tag."""
    tag_live(output, OUTPUT)
    tag_untagged_live(FORWARD_VALUE)


@contextlib.contextmanager
def gradients_tagged(state: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside, each parameter's ``.grad`` is tagged ``GRADIENT`` in the tracker once accumulated,
    so the gradients alive at the peak are known even when a fused optimizer step frees them
    before the run ends (enter this before ``fused_steps_on_fakes``: hooks run in order)."""
    handles = [t.register_post_accumulate_grad_hook(lambda p: tag_live(p.grad, GRADIENT))
               for t in {id(t): t for t in state}.values() if t.is_leaf and t.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def gradients_released(state: dict[str, torch.Tensor], names: frozenset[str]) -> Iterator[None]:
    """Inside, the gradients of the parameters ``names`` are dropped as soon as they are
    accumulated: what FSDP2 does to a sharded block's full gradients when it reduce-scatters
    them (a little later, when the block's backward ends; the 1/N shard it keeps is not
    counted). Enter after ``gradients_tagged``: hooks run in order."""
    handles = [state[name].register_post_accumulate_grad_hook(_drop_grad)
               for name in sorted(names) if name in state and state[name].requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _drop_grad(parameter: torch.Tensor) -> None:
    parameter.grad = None


def _inference(module: nn.Module, inputs: tuple) -> None:
    with training_flags(module, False), torch.no_grad():
        module(*inputs)


def _train(module: nn.Module, inputs: tuple) -> str:
    with training_flags(module, True), torch.enable_grad():
        return describe_step(training_step(module, inputs, after_forward=_tag_what_forward_left))


def _train_watching_saved(module: nn.Module, inputs: tuple) -> str:
    """``_train``, watching what backward takes back of what forward saved
    (``_SavedForBackward``): a run 6-14% slower, for the prediction whose ``forward_bytes``
    decides something (the checkpoint pass's first)."""
    with _SavedForBackward().watched():
        return _train(module, inputs)


class _SavedForBackward:
    """What forward saved for backward, watched through autograd's saved-tensor hooks: once
    backward has unpacked every saved copy of a storage, it no longer holds it for backward
    (``mark_handed_back``). A forward value still alive at a later peak is then held for
    something else, which no region can drop: a gradient that forward made and backward passed
    on (the chunked loss's weight gradient, held until a tied embedding's own arrives).

    Each pack returns a record of its own, so a backward that unpacks one twice counts once.
    Backward gets back what autograd alone would give it where that matters: a leaf (a
    parameter, an input) itself, since code may look it up by identity (the chunked loss hands
    its weight's gradient to a fused step found by the weight); any other tensor as a detached
    alias, never itself (``fxopt.analysis.saved``: a hook that holds a node's own output keeps
    its graph alive). Checkpointed regions pack through their own hooks inside, unseen here:
    their inputs stay forward values until the end."""

    def __init__(self) -> None:
        self.outstanding: dict[int, int] = {}  # storage key -> packs not unpacked yet

    @contextlib.contextmanager
    def watched(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> list:
        key = storage_key(t)
        self.outstanding[key] = self.outstanding.get(key, 0) + 1
        return [t if t.grad_fn is None else t.detach(), key, False]

    def _unpack(self, packed: list) -> torch.Tensor:
        t, key, done = packed
        if not done:
            packed[2] = True
            self.outstanding[key] -= 1
            if not self.outstanding[key]:
                del self.outstanding[key]
                mark_handed_back(t)
        return t


def released_gradients(module: nn.Module, training: TrainingSetup) -> frozenset[str]:
    """Parameters whose gradients leave once accumulated: under per-block FSDP2
    (``training.sharded_blocks``), those of the blocks ``module``'s graph runs
    (``fxopt.analysis.blocks.block_parameter_names``); else none."""
    graph = getattr(module, "graph", None)
    if not training.sharded_blocks or graph is None:
        return frozenset()
    return block_parameter_names(module, graph)


def estimate_train_peak(module: nn.Module, example_inputs: Any, *,
                        training: TrainingSetup | None = None,
                        watch_saved: bool = False) -> TrainPeak:
    """Predicted training-step peak of ``module`` on ``example_inputs`` (no inference run), for
    the training ``training`` describes (default: full precision, no fused optimizer step, not
    sharded). ``watch_saved``: ``forward_bytes`` leaves out what backward had taken back by
    the peak (``_SavedForBackward``); without it, it counts all forward left alive, which can
    only be more."""
    step = _train_watching_saved if watch_saved else _train
    return _tracked(module, example_inputs, step, training or TrainingSetup())


def estimate_inference_peak(module: nn.Module, example_inputs: Any, *,
                            training: TrainingSetup | None = None) -> int:
    """Predicted inference peak (bytes, baseline included) of ``module`` (no training run), in
    ``training``'s precision."""
    return _tracked(module, example_inputs, _inference, training or TrainingSetup()).bytes


def estimate_peak(module: nn.Module, example_inputs: Any = (), *,
                  example_kwargs: dict[str, Any] | None = None,
                  fused_optimizer: FusedOptimizers = None,
                  training: TrainingSetup | None = None) -> PeakEstimate:
    """Predicted training-step and inference peaks of ``module`` on ``example_inputs`` (forward's
    positional arguments) and ``example_kwargs`` (its keyword ones, bound by name as
    ``fxopt.optimize`` binds them: a Hugging Face batch), for the training ``training``
    describes (``fxopt.TrainingSetup``); ``fused_optimizer``: what ``fxopt.fuse_optimizer``
    returned for the training, if it fuses (a shorthand for
    ``training=TrainingSetup(fused_optimizer=...)``)."""
    example_inputs = _bound(module, example_inputs, example_kwargs)
    training = _setup(training, fused_optimizer)
    train = estimate_train_peak(module, example_inputs, training=training)
    inference = _tracked(module, example_inputs, _inference, training)
    return PeakEstimate(train.bytes, inference.bytes, train.baseline_bytes, train.op,
                        inference.op, train.grad_bytes, train.fused.optimizer_state_bytes,
                        train.fused.parameters, train.optimizer_step_bytes, train.backward_from)


def _bound(module: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None) -> Any:
    """With keywords, the inputs as ``optimize`` takes them (``check_inputs``: one positional
    call); without, as given."""
    return check_inputs(module, example_inputs, example_kwargs) if example_kwargs else (
        example_inputs)


def _setup(training: TrainingSetup | None, fused_optimizer: FusedOptimizers) -> TrainingSetup:
    training = training or TrainingSetup()
    if fused_optimizer is not None:
        training = training.with_(fused_optimizer=fused_optimizer)
    return training


def resized_inputs(example_inputs: Any, batch: int, batch_dim: int = 0) -> tuple:
    """Fake inputs like ``example_inputs`` with ``batch`` along ``batch_dim`` (no real memory).

    Tensors with fewer than ``batch_dim + 1`` dimensions are passed through unchanged.
    """
    mode = FakeTensorMode()

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= batch_dim:
            return t
        shape = list(t.shape)
        shape[batch_dim] = batch
        with mode:
            return torch.empty(shape, dtype=t.dtype, device=t.device).requires_grad_(
                t.requires_grad)

    return tuple(resize(t) for t in as_args(example_inputs))


_LARGEST_REFERENCE = 2**20


def max_batch_size(model: nn.Module, example_inputs: Any, budget_bytes: int, *,
                   example_kwargs: dict[str, Any] | None = None, batch_dim: int = 0,
                   fused_optimizer: FusedOptimizers = None,
                   training: TrainingSetup | None = None) -> int:
    """Largest batch whose predicted training peak is at most ``budget_bytes``; every input
    tensor, keyword ones (``example_kwargs``) included, is resized along ``batch_dim``."""
    example_inputs = _bound(model, example_inputs, example_kwargs)
    peaks: dict[int, int] = {}
    training = _setup(training, fused_optimizer)

    def peak(batch: int) -> int:
        if batch not in peaks:
            inputs = resized_inputs(example_inputs, batch, batch_dim)
            peaks[batch] = estimate_train_peak(model, inputs, training=training).bytes
        return peaks[batch]

    if peak(1) > budget_bytes:
        raise BudgetError(
            f"even batch 1 does not fit: its predicted training peak is {peak(1):,} bytes, "
            f"over the budget of {budget_bytes:,} bytes",
            where=f"max_batch_size({type(model).__name__}, batch_dim={batch_dim})",
            hint=f"raise the budget to at least {peak(1):,} bytes, or shrink the model "
                 "(e.g. with the checkpoint pass)")
    reference = max(2, next((t.shape[batch_dim] for t in tensors_in(as_args(example_inputs))
                             if t.dim() > batch_dim), 2))
    while peak(reference) <= peak(1) and reference < _LARGEST_REFERENCE:
        reference *= 8  # a batch-independent op (an embedding's grad) can hold the peak at first
    per_sample = (peak(reference) - peak(1)) / (reference - 1)
    if per_sample <= 0:
        raise InputError(
            f"the predicted peak does not grow with the batch along dim {batch_dim} "
            f"({peak(1):,} bytes at batch 1, {peak(reference):,} at batch {reference})",
            where=f"max_batch_size({type(model).__name__})",
            hint="pass batch_dim= naming the inputs' batch dimension")
    guess = max(1, int((budget_bytes - peak(1)) // per_sample) + 1)
    return _largest_fitting(lambda b: peak(b) <= budget_bytes, guess)


def _largest_fitting(fits: Callable[[int], bool], guess: int) -> int:
    """Largest b >= 1 with fits(b), for monotone ``fits`` with fits(1); checks guess, guess+1 first."""
    fitting, failing = 1, None
    for batch in (guess, guess + 1):
        if batch > fitting and (failing is None or batch < failing):
            if fits(batch):
                fitting = batch
            else:
                failing = batch
    while failing is None:
        batch = 2 * fitting
        if fits(batch):
            fitting = batch
        else:
            failing = batch
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    return fitting
