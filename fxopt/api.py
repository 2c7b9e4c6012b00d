"""``fxopt.optimize``: capture, rewrite, verify, (optionally) measure.

The result is a GraphModule that owns the user's Parameter objects (an optimizer built on either
model trains the other), has the same ``state_dict()`` keys, order and shapes (checkpoints load
both ways), and carries its Report as ``.fxopt_report``. The user's model object is never
modified: capture works on a structural copy, and verification and measurement restore grads,
buffers, training flags and the RNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

import fxopt.passes as builtin_passes
from fxopt.analysis.device_memory import measure_device_memory
from fxopt.analysis.leaf_runs import measure_leaves
from fxopt.analysis.prediction_memo import predictions_remembered
from fxopt.capture.chain import capture as capture_chain
from fxopt.capture.chain import check_capture_option
from fxopt.capture.reuse import reused_capture
from fxopt.graph.meta import drop_autograd_history
from fxopt.graph.pickling import refuse_pickling
from fxopt.core import meta_keys
from fxopt.core.errors import BudgetError, EquivalenceError, InputError
from fxopt.core.graphs import placeholder_values
from fxopt.core.inputs import check_inputs, refuse_meta_tensors
from fxopt.core.modules import carry_constants, structural_copy, wrap_own_calls
from fxopt.graph.sequential import keep_sequential_interface
from fxopt.core import progress
from fxopt.integrations.hf_trainer import keep_pretrained_interface, tell_about_trainer_checkpoints
from fxopt.core.state import preserved_state
from fxopt.core.tensors import module_device
from fxopt.core.training_setup import TrainingSetup, ambient_autocast
from fxopt.measure.budget_check import check_wanted, keep_budget
from fxopt.measure.peaks import measure, measure_train_step
from fxopt.planning.budget import is_min
from fxopt.measure.report import PhaseClock, Report, predicted_peaks
from fxopt.integrations.call_guard import guard_calls
from fxopt.rewrite.pipeline import Config, PassRequest, run_passes
from fxopt.rewrite.registry import PassRegistry
from fxopt.runtime.fused_step import FusedOptimizers, fused_optimizers
from fxopt.verify.blame import capture_blamed
from fxopt.verify.fitting import check_mode as check_verify_mode
from fxopt.verify.fitting import verify_where_it_fits


def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    passes: list[PassRequest] | str | None = None,
    memory_budget: int | float | str | None = None,
    verify: bool | str = True,
    measure_memory: bool = False,
    leaf_modules: tuple[str, ...] = (),
    dump_dir: str | Path | None = None,
    registry: PassRegistry | None = None,
    capture: str = "auto",
    example_kwargs: dict[str, Any] | None = None,
    predict_memory: bool = True,
    fused_optimizer: FusedOptimizers = None,
    shard_blocks: bool = False,
    outputs: str = "all",
    check_budget: bool | None = None,
    captured: fx.GraphModule | None = None,
    dynamic: bool = True,
) -> fx.GraphModule:
    """Return an optimized, verified GraphModule computing the same function as ``model``.

    ``passes``: None for the default pipeline, a list of names or (name, options) pairs, or a
    spec string like ``"inplace,checkpoint{budget=0.5}"``. ``memory_budget``: bytes, a string
    ("2GiB"), a fraction of the unoptimized activation memory, or ``"min"`` (the least memory
    checkpointing reaches, at whatever recompute time); it enables checkpointing.
    ``verify``: run the equivalence check and raise ``EquivalenceError`` on any mismatch.
    ``True`` (``"auto"``) runs it where it fits: at the example size, or, on a GPU where the
    original's training step does not fit (the reason to call ``optimize``), at a smaller batch
    of the same inputs, or on CPU copies (``fxopt.verify.fitting``); ``"full"``, ``"reduced"``
    and ``"cpu"`` choose; the report says where it ran.
    ``measure_memory``: measure peak memory before and after (real training steps).
    ``predict_memory``: predict the training and inference peaks before and after on fake
    tensors (no compute; four fake runs) so the report says whether memory went down.
    ``registry``: the passes to choose from (default ``passes.REGISTRY``); add a pass of your own
    with ``passes.REGISTRY.with_pass(fxopt.rewrite.registry.PassSpec(name, fn, summary))``.
    ``capture``: the capture frontend (``fxopt.capture.chain``): "auto" (symbolic tracing when it
    captures the whole model, else torch.export, else tracing with opaque leaves), "fx" or
    "export". The report says which one captured the model and why the others did not.
    ``dynamic``: with torch.export, True (default) leaves the batch and sequence sizes free where
    the model's code allows, so one module serves every length (three traces: train mode, eval
    mode, a batch of one); False captures the example's sizes only, in two traces each 2-3 times
    faster on a Hugging Face language model, and the module then refuses other sizes with an
    ``InputError`` before computing. For training at one fixed shape (packed or padded-to-length
    batches). Symbolic tracing records no sizes, so it serves any either way.
    ``captured``: a capture of ``model`` on these example inputs made by
    ``fxopt.capture_model(model, example_inputs, ...)``, to start from instead of capturing
    again (a budget sweep captures once). It is copied, never edited; a capture of another
    model, of a model changed since, or of other inputs is refused with a ``ConfigError``
    before any compute (``fxopt.capture.reuse``).
    ``leaf_modules``: submodule paths to keep as opaque calls, with either frontend. A leaf that
    reads tensor values (``if x.mean() > 0``, ``torch.where`` dispatch) is run for real on the
    example inputs and replays that run in every prediction, so peaks, plans and the report
    count what it allocates and saves (``fxopt.graph.leaf_tape``); the report says so.
    ``fused_optimizer``: the ``FusedOptimizer`` your training steps ``model``'s parameters with
    (``fused = fxopt.fuse_optimizer(model, torch.optim.AdamW, lr=...)``; several in a tuple):
    each gradient is freed at its step in backward, and the checkpoint plan and the predicted
    peaks count that. Only the one given here counts: a fused optimizer alive elsewhere in the
    process changes nothing.
    ``shard_blocks``: plan for FSDP2 with ``fully_shard`` on each of ``fxopt.blocks(module)``
    and then the root: a block's parameter gradients are reduce-scattered when its backward
    ends instead of piling up to the end of backward, so the memory goes to activations (the
    plan leans towards recomputing whole blocks). The report's predicted peaks count the
    gradients leaving likewise, with parameters unsharded (one device's view).
    ``outputs``: ``"all"`` (default: the optimized module returns everything the model returns)
    or ``"loss"``, for training loops that read only the loss (``out.loss.backward()``, as
    Hugging Face's ``Trainer`` does): logits the model only returns are then not built in a
    training step (a language model's batch x sequence x vocab tensor), and reading them raises
    an error that says so; evaluation under ``torch.no_grad()`` returns them as before.

    ``check_budget``: run one real training step of the planned module and, when its peak is
    over ``memory_budget``, plan again for the budget less what the plan's prediction missed
    (``fxopt.measure.budget_check``). None (default): on wherever predictions are not exact (a
    GPU, whose kernels hold workspaces fake tensors cannot see), off on the CPU. With
    ``memory_budget="min"`` it measures what the device really reaches.

    The training step is planned as it will run: on the device the model is on, under the
    ``torch.autocast`` active where ``optimize`` is called (call it inside your autocast
    context), with the fused optimizer step, sharding and outputs above (``fxopt.TrainingSetup``;
    the report says which).

    ``example_inputs`` are the *positional* arguments of ``model.forward``: one tensor, or a
    tuple (or list) with one entry per argument. An entry may itself be a tuple, list or dict of
    tensors (for a forward that takes a dict, pass ``(inputs_dict,)``), or a plain value (None,
    bool, int, float, str); plain values, and trailing arguments left out (they take their
    defaults), are fixed in the optimized module, which checks it is called with the same
    values. A bare dict is refused with an ``InputError``, because it could mean either.
    ``example_kwargs``: keyword example inputs, as Hugging Face models are called
    (``example_kwargs={"input_ids": ids, "labels": ids}``, with ``example_inputs=()``). They are
    bound to forward's parameters by name (``fxopt.core.inputs.bind_keywords``); the optimized
    module takes them by keyword or by position, and parameters skipped before the last one
    given are fixed at their defaults.

    Progress: each phase (capture, predict, each pass, verify, measure) is logged to the
    ``"fxopt"`` logger at its start and end, with its seconds, and shown on a status line when
    stderr is a terminal; quiet in a pipe unless ``FXOPT_PROGRESS=1`` (``fxopt.core.progress``).
    For a transformers ``PreTrainedModel`` it warns (``TrainerCheckpointWarning``) that
    ``Trainer`` needs ``callbacks=[fxopt.pretrained_checkpoints()]`` to write checkpoints that
    load as the model.

    Errors are ``fxopt.FxoptError`` subclasses: ``InputError`` (not a module, unusable inputs,
    a model that does not run on them), ``TraceError``, ``ConfigError``, ``BudgetError``,
    ``PassError`` (a pass crashed: a bug), ``EquivalenceError`` (verification failed: a bug).
    Whatever happens, the user's model is left as it was: parameters, gradients, buffers,
    module flags and the RNG state.
    """
    with progress.phase(f"optimize {type(model).__name__}"):
        gm = _optimize(model, example_inputs, passes=passes, memory_budget=memory_budget,
                       verify=verify, measure_memory=measure_memory, leaf_modules=leaf_modules,
                       dump_dir=dump_dir, registry=registry, capture=capture,
                       example_kwargs=example_kwargs, predict_memory=predict_memory,
                       fused_optimizer=fused_optimizer, shard_blocks=shard_blocks,
                       outputs=outputs, check_budget=check_budget, captured=captured,
                       dynamic=dynamic)
    tell_about_trainer_checkpoints(model)
    return gm


def _optimize(model: nn.Module, example_inputs: Any, *, passes: Any, memory_budget: Any,
              verify: bool | str, measure_memory: bool, leaf_modules: tuple[str, ...],
              dump_dir: Any, registry: PassRegistry | None, capture: str,
              example_kwargs: dict[str, Any] | None, predict_memory: bool,
              fused_optimizer: FusedOptimizers, shard_blocks: bool, outputs: str,
              check_budget: bool | None, captured: fx.GraphModule | None,
              dynamic: bool) -> fx.GraphModule:
    registry = builtin_passes.REGISTRY if registry is None else registry
    verify_mode = check_verify_mode(verify) if verify is not False else None
    fused_optimizers(fused_optimizer)  # refuse what is no FusedOptimizer before any work
    training = TrainingSetup(fused_optimizer=fused_optimizer, sharded_blocks=shard_blocks,
                             outputs=outputs)
    config = Config(passes=passes, memory_budget=memory_budget, dump_dir=dump_dir)
    config.resolved(registry)  # fail on a bad pass list before spending time on tracing
    check_capture_option(capture, leaf_modules, dynamic)
    args = check_inputs(model, example_inputs, example_kwargs)
    device = module_device(model, args)
    config.training = training = training.with_(device=device, autocast=ambient_autocast(device))
    if verify or measure_memory:
        refuse_meta_tensors("verify" if verify else "measure", model, args)
    # Whatever tracing or a pass does to the user's tensors (a forward run eagerly, a timing
    # run drawing random numbers, a pass that crashes half-way) is undone here.
    clock = PhaseClock()
    with preserved_state(model), predictions_remembered() as predictions:
        with clock("capture"):
            gm = (capture_chain(model, args, capture=capture, leaf_modules=leaf_modules,
                                dynamic=dynamic)
                  if captured is None else reused_capture(captured, model, args,
                                                          capture=capture,
                                                          leaf_modules=leaf_modules,
                                                          dynamic=dynamic))
            measure_leaves(gm, args)  # opaque leaves' memory on a real run, for the report
            # the module as captured: to blame a failed verification on capture or passes,
            # and to plan again when a real step lands over the budget
            checked = check_wanted(check_budget, device.type, memory_budget)
            captured = structural_copy(gm) if verify or checked else None
        if device.type != "cpu":  # what fake tensors cannot see, measured on the device
            with clock("device"):
                config.training = training = training.with_(device_memory=measure_device_memory(
                    gm, placeholder_values(gm), training))
        report = Report(model=type(model).__name__, trace=gm.meta[meta_keys.TRACE],
                        seconds=clock.seconds, training=training)
        with clock("predict"):
            report.predicted_before = (predicted_peaks(gm, training) if predict_memory
                                       else None)
        with clock("passes"):
            try:
                report.passes = run_passes(gm, config, registry)
            except BudgetError:  # a model that cannot run on its inputs is the cause, if so
                refuse_a_model_that_does_not_run(model, args)
                raise
        if checked:
            with clock("budget check"):
                gm, report.passes, report.budget_check = keep_budget(
                    gm, captured, report.passes, config, registry,
                    lambda module: measure_train_step(module, args, training=training).peak_bytes,
                    device=str(device), minimum=is_min(memory_budget))
        with clock("predict"):
            report.predicted_after = (predicted_peaks(gm, training) if predict_memory
                                      else None)
    report.predictions = {"run": predictions.run, "remembered": predictions.remembered}
    drop_autograd_history(gm)
    copy_training_flags(model, gm)
    if wrap_own_calls(gm.graph):  # the calls passes added stay calls when torch.load re-traces
        gm.recompile()
    refuse_pickling(gm)  # a pass may have rebuilt the module
    keep_pretrained_interface(gm, model, args)  # what trainers read off a Hugging Face model
    keep_sequential_interface(gm, model)  # slim[0], len(slim) for a Sequential model
    carry_constants(model, gm)  # the root's scalar attributes, readable and guarded
    guard_calls(gm)  # records the module as returned; verification's calls then pass through it
    if verify:
        with clock("verify"):
            try:
                verified = verify_where_it_fits(model, gm, args, mode=verify_mode,
                                                training=training, strict=True)
                report.verification, report.verified_where = verified.report, verified.where
            except EquivalenceError as error:  # the passes' doing, or the capture's?
                inputs = getattr(error, "inputs", args)  # where the proof ran
                if inputs is None:
                    raise
                raise capture_blamed(
                    error, frontend=report.trace.frontend, not_used=report.trace.not_used,
                    passes_changed=[p.name for p in report.passes if p.modified], model=model,
                    args=inputs, unoptimized=captured) from error
    if measure_memory:
        with clock("measure"):
            report.memory_before = measure(model, args)
            report.memory_after = measure(gm, args)
    gm.fxopt_report = report
    return gm


def refuse_a_model_that_does_not_run(model: nn.Module, args: tuple) -> None:
    """``InputError`` when ``model``'s forward fails on ``args`` (an int64 tensor into a
    ``Linear``): fake tensors do not check every dtype rule, so such a model can reach a budget
    it cannot meet, and the budget is then not the problem. Runs one forward without autograd,
    only on that error's path (the caller preserves the model's state)."""
    try:
        with torch.no_grad():
            model(*args)
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0]
        raise InputError(
            f"{type(model).__name__} does not run on the example inputs: "
            f"{type(error).__name__}: {first}",
            where=f"{type(model).__name__}.forward on the example inputs",
            hint="check that the model runs a forward and a backward on these example inputs "
                 "without fxopt (dtypes: token ids go to an nn.Embedding, floats to "
                 "nn.Linear)") from error


def copy_training_flags(model: nn.Module, gm: fx.GraphModule) -> None:
    """Give every module of ``gm`` the ``training`` flag of the user's module at the same path
    (a BatchNorm the user froze in eval stays in eval)."""
    gm.training = model.training
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            try:
                gm.get_submodule(name).training = module.training
            except AttributeError:  # a pass replaced or removed it; keep its own flag
                pass
