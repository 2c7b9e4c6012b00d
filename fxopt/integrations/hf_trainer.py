"""What the optimized module of a Hugging Face model keeps of the model's interface, for trainers.

Trainers read more off a model than its ``forward``: Hugging Face's ``Trainer`` reads ``config``
(and sets ``config.use_cache``), ``accepts_loss_kwargs`` or forward's signature, ``loss_type``,
``main_input_name``, ``num_parameters``, ``_keys_to_ignore_on_save`` and ``_get_name()``, and
calls ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` when asked to;
scripts call ``save_pretrained``. The optimized module is a GraphModule, so for a transformers
``PreTrainedModel`` fxopt gives it ``PretrainedInterface``: exactly the names in ``DELEGATED``,
each answered from the original model or from the optimized module's live state, and the names in
``REFUSED``, each raising an fxopt error that says why. Nothing else falls through to the
original: any other name is an ``AttributeError``, as on any module, so no method of the original
ever runs on state the optimized module no longer uses (``tests/test_trainers.py`` checks the
class defines these names and no others).

Where the answers come from: ``keep_pretrained_interface(gm, model)`` keeps a *stand-in* of the
original, a structural copy of its module tree whose parameters and buffers are zero-size-cost
meta tensors, with deep copies of ``config`` and ``generation_config``. It holds no weights and
no reference to the user's model, so replacing or sharding the optimized module's parameters
frees the originals. ``save_pretrained`` runs the original class's ``save_pretrained`` on the
stand-in with the optimized module's ``state_dict()`` at the time of the call (the same keys as
the original's), so what a checkpoint holds is what the optimized module trains with; its
``config.json`` names the original class, which therefore loads it with ``from_pretrained``.

``Trainer`` itself calls ``save_pretrained`` only on a ``PreTrainedModel`` (transformers
``Trainer._save``); for any other module it writes the state dict alone, without
``config.json``. ``pretrained_checkpoints()`` is a ``TrainerCallback`` that completes each
checkpoint the Trainer saves by calling the optimized module's ``save_pretrained`` into it; the
final ``trainer.save_model(dir)`` is not a checkpoint event, so save the final model with
``trainer.model.save_pretrained(dir)``.

Not handled: gradient accumulation with a varying number of labelled tokens per micro-batch. The
original accepts ``num_items_in_batch`` and normalizes its loss over the whole accumulated batch;
the optimized forward takes the arguments it was captured with, so ``accepts_loss_kwargs`` is
False and Trainer averages per micro-batch (the same when every micro-batch has as many labelled
tokens, as without padding). Copies made with ``copy.copy`` or by pickling are plain GraphModules
without this interface (``copy.deepcopy`` and fxopt's own copies keep it).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from typing import Any

import torch
from torch import fx, nn

from fxopt.core.errors import ConfigError, ExportError, InputError
from fxopt.core.modules import deepcopy_keeping_hooks, structural_copy
from fxopt.core.torch_private import MODULE_NAME_METHOD, without_call_wrapper

_STAND_IN = "_fxopt_pretrained"

# Each name the optimized module of a Hugging Face model answers, and who reads it and why.
DELEGATED: dict[str, str] = {
    "config": "Trainer reads it and sets config.use_cache; save_pretrained writes it as "
              "config.json (a deep copy of the original's: the user's model is not changed, and "
              "the graph, captured under the original config, does not read it)",
    "generation_config": "save_pretrained writes it; Trainer aligns its special tokens with the "
                         "tokenizer's (a deep copy of the original's)",
    "main_input_name": "Trainer counts input tokens and floating point operations from it",
    "loss_type": "Trainer counts the labelled tokens of a causal LM from labels[..., 1:]",
    "_keys_to_ignore_on_save": "Trainer's warnings after loading a checkpoint read it",
    "accepts_loss_kwargs": "False: the optimized forward takes only the arguments it was "
                           "captured with, so Trainer must not pass num_items_in_batch",
    "num_parameters": "Trainer's floating point operation count; counts the optimized module's "
                      "live parameters, the original's embeddings excluded on request",
    MODULE_NAME_METHOD: "the original class's name: Trainer's label smoother shifts the labels "
                        "of causal LMs, which it recognizes by this name",
    "can_generate": "False: the optimized module cannot generate (see generate); a checkpoint it "
                    "saves still carries the generation config",
    "save_pretrained": "the original class's save_pretrained with the optimized module's current "
                       "state_dict(), under the original's keys",
}

# Each name the optimized module of a Hugging Face model refuses, and why.
REFUSED: dict[str, str] = {
    "gradient_checkpointing_enable": "fxopt already plans what is recomputed",
    "gradient_checkpointing_disable": "fxopt already plans what is recomputed",
    "activation_checkpointing_enable": "fxopt already plans what is recomputed",
    "activation_checkpointing_disable": "fxopt already plans what is recomputed",
    "generate": "the optimized forward serves the calls it was captured for, not decoding with a "
                "key/value cache",
    "resize_token_embeddings": "parameter shapes are fixed when the model is captured",
    "get_input_embeddings": "hooks on the embedding module (NEFTune, enable_input_require_grads) "
                            "do not fire where the optimized graph does not call it",
    "enable_input_require_grads": "it hooks the embedding module, which the optimized graph need "
                                  "not call",
}


class PretrainedInterface(fx.GraphModule):
    """Base of the class of an optimized Hugging Face model; its members are exactly DELEGATED
    and REFUSED, besides ``__deepcopy__`` (which copies the stand-in too) and helpers named
    ``_fxopt_*``."""

    accepts_loss_kwargs = False

    def _fxopt_stand_in(self) -> nn.Module:
        return self.__dict__[_STAND_IN]

    @property
    def config(self) -> Any:
        return self._fxopt_stand_in().config

    @config.setter
    def config(self, value: Any) -> None:
        self._fxopt_stand_in().config = value

    @property
    def generation_config(self) -> Any:
        return getattr(self._fxopt_stand_in(), "generation_config", None)

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        self._fxopt_stand_in().generation_config = value

    @property
    def main_input_name(self) -> str:
        return self._fxopt_stand_in().main_input_name

    @property
    def loss_type(self) -> str | None:
        return getattr(self._fxopt_stand_in(), "loss_type", None)

    @property
    def _keys_to_ignore_on_save(self) -> Any:
        return self._fxopt_stand_in()._keys_to_ignore_on_save

    def _get_name(self) -> str:  # MODULE_NAME_METHOD
        return type(self._fxopt_stand_in()).__name__

    def can_generate(self) -> bool:
        return False

    def num_parameters(self, only_trainable: bool = False,
                       exclude_embeddings: bool = False) -> int:
        """As ``PreTrainedModel.num_parameters``, over this module's live parameters."""
        embeddings = {f"{name}.weight" for name, module in self._fxopt_stand_in().named_modules()
                      if isinstance(module, nn.Embedding)} if exclude_embeddings else set()
        return sum(p.numel() for name, p in self.named_parameters()
                   if name not in embeddings and (p.requires_grad or not only_trainable))

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any,
                        state_dict: dict[str, torch.Tensor] | None = None, **kwargs: Any) -> Any:
        """The original class's ``save_pretrained`` (same arguments) with this module's current
        ``state_dict()``: ``OriginalClass.from_pretrained(save_directory)`` loads what this
        module holds now."""
        stand_in = self._fxopt_stand_in()
        state = self.state_dict() if state_dict is None else state_dict
        expected = stand_in.state_dict().keys()
        if state_dict is None and state.keys() != expected:
            missing, extra = sorted(expected - state.keys()), sorted(state.keys() - expected)
            raise ExportError(
                f"the optimized {type(stand_in).__name__} has other state_dict keys than the "
                f"original (missing {missing[:3]}, extra {extra[:3]}), so the original class "
                "could not load what save_pretrained would write",
                where=f"{type(stand_in).__name__}.save_pretrained({str(save_directory)!r})",
                hint="this is a bug in fxopt: report it; meanwhile save the original model")
        _match_dtypes(stand_in, state)
        return stand_in.save_pretrained(save_directory, *args, state_dict=state, **kwargs)

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self._fxopt_refuse_checkpointing("gradient_checkpointing_enable")

    def gradient_checkpointing_disable(self, *args: Any, **kwargs: Any) -> None:
        self._fxopt_refuse_checkpointing("gradient_checkpointing_disable")

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self._fxopt_refuse_checkpointing("activation_checkpointing_enable")

    def activation_checkpointing_disable(self, *args: Any, **kwargs: Any) -> None:
        self._fxopt_refuse_checkpointing("activation_checkpointing_disable")

    def generate(self, *args: Any, **kwargs: Any) -> None:
        name = self._get_name()
        raise InputError(
            f"the optimized {name} cannot generate: its forward serves the calls it was captured "
            "for (training and evaluation steps), not decoding with a key/value cache",
            where=f"{name}.generate", hint=f"save it with .save_pretrained(dir) and generate with "
            f"{name}.from_pretrained(dir)")

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> None:
        name = self._get_name()
        raise InputError(
            f"the optimized {name} cannot resize its token embeddings: parameter shapes are "
            "fixed when the model is captured", where=f"{name}.resize_token_embeddings",
            hint="resize the original model's embeddings, then optimize it")

    def get_input_embeddings(self) -> None:
        self._fxopt_refuse_embedding_hooks("get_input_embeddings")

    def enable_input_require_grads(self) -> None:
        self._fxopt_refuse_embedding_hooks("enable_input_require_grads")

    def _fxopt_refuse_checkpointing(self, method: str) -> None:
        name = self._get_name()
        raise ConfigError(
            f"fxopt already plans activation checkpointing for the optimized {name}: it decides "
            "what backward recomputes, and Hugging Face's checkpointing cannot be switched on or "
            "off on top of that plan",
            where=f"{name}.{method}",
            hint="leave gradient_checkpointing / activation_checkpointing off in "
                 "TrainingArguments; choose how much to recompute with fxopt.optimize(model, ..., "
                 "memory_budget=...) (\"min\": the least memory), or optimize without "
                 "memory_budget for no checkpointing")

    def _fxopt_refuse_embedding_hooks(self, method: str) -> None:
        name = self._get_name()
        raise InputError(
            f"the optimized {name} does not hand out its embedding module: hooks registered on it "
            "(NEFTune noise, enable_input_require_grads) would not fire where the optimized graph "
            "does not call it", where=f"{name}.{method}",
            hint="turn off neftune_noise_alpha; register such hooks on the original model before "
                 "optimizing it")

    def __deepcopy__(self, memo: dict) -> fx.GraphModule:
        base = super().__deepcopy__  # the instance class's own (hooks kept, eval graph), except
        # on a copy, whose class torch.fx derives from this one alone: then the hooks' keeper
        plain = getattr(base, "__func__", None) is fx.GraphModule.__deepcopy__
        copied = deepcopy_keeping_hooks(self, memo) if plain else base(memo)
        object.__setattr__(copied, _STAND_IN, copy.deepcopy(self.__dict__[_STAND_IN], memo))
        return copied


def is_pretrained_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers:
    a model of that class means it is imported already)."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None)
    return pretrained is not None and isinstance(model, pretrained)


def keep_pretrained_interface(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give ``gm``, the optimized module of ``model``, the interface in DELEGATED and REFUSED when
    ``model`` is a transformers ``PreTrainedModel`` or an optimized one (optimized again); any
    other model is left alone.

    ``gm``'s class becomes a subclass of its own class and of ``PretrainedInterface`` (torch.fx
    gives every GraphModule a class of its own), so its forward and anything set on its class
    stay; deep copies and fxopt's structural copies keep the interface.
    """
    if isinstance(gm, PretrainedInterface):
        return
    if isinstance(model, PretrainedInterface):
        stand_in = copy.deepcopy(model._fxopt_stand_in())
    elif is_pretrained_model(model):
        stand_in = _stand_in(model)
    else:
        return
    object.__setattr__(gm, _STAND_IN, stand_in)
    # Named like torch.fx's per-instance classes, so that a copy's class derives from
    # PretrainedInterface (GraphModule.__new__ skips classes of that name).
    # Its __name__ stays the model's (LlamaForCausalLM): what an export names its class and a
    # repr shows (only __qualname__ matters to GraphModule.__new__).
    # Over type(gm) less its call wrapper: recompile() makes the new class's own.
    base = type(gm)
    gm.__class__ = type("GraphModuleImpl", (PretrainedInterface, without_call_wrapper(base)), {})
    gm.__class__.__name__ = base.__name__
    gm.recompile()


def _stand_in(model: nn.Module) -> nn.Module:
    """A module tree of ``model``'s class and structure holding meta tensors and copies of its
    configs: enough to run its ``save_pretrained`` on a given state dict."""
    stand_in = structural_copy(model)
    metas: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in metas:  # tied weights stay tied
            empty = torch.empty_like(t, device="meta")
            metas[id(t)] = (nn.Parameter(empty, requires_grad=t.requires_grad)
                            if isinstance(t, nn.Parameter) else empty)
        return metas[id(t)]

    for module in stand_in.modules():
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            setattr(module, name, meta(tensor))
    stand_in.config = copy.deepcopy(model.config)
    if getattr(model, "generation_config", None) is not None:
        stand_in.generation_config = copy.deepcopy(model.generation_config)
    return stand_in


def _match_dtypes(stand_in: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give the stand-in's meta parameters the dtypes of ``state`` (a module converted with
    ``.to(torch.bfloat16)`` saves ``"dtype": "bfloat16"`` in its config, as the original would)."""
    for module_name, module in stand_in.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            live = state.get(f"{module_name}.{name}" if module_name else name)
            if live is not None and live.dtype != p.dtype:
                setattr(module, name, nn.Parameter(torch.empty_like(p, dtype=live.dtype),
                                                   requires_grad=p.requires_grad))


class TrainerCheckpointWarning(UserWarning):
    """An optimized Hugging Face model needs ``callbacks=[fxopt.pretrained_checkpoints()]`` in
    ``Trainer`` for its checkpoints to load with ``from_pretrained``."""


def tell_about_trainer_checkpoints(model: nn.Module) -> None:
    """Say, when ``model`` is a transformers ``PreTrainedModel``, what ``Trainer`` needs to write
    checkpoints of its optimized module that load as this model.

    ``Trainer`` writes a bare state dict for any module that is not a ``PreTrainedModel`` (the
    optimized module is a GraphModule): no ``config.json``. ``from_pretrained`` on such a folder
    builds the class's *default* configuration (a 7B Llama for ``LlamaForCausalLM``), another
    model, and may exhaust memory doing so. Nothing on the module side can change what
    ``Trainer`` writes, so this says it when the model is optimized, once per call site
    (``warnings``: silence it with ``warnings.filterwarnings("ignore",
    category=fxopt.integrations.hf_trainer.TrainerCheckpointWarning)``)."""
    if not is_pretrained_model(model) or isinstance(model, PretrainedInterface):
        return
    name = type(model).__name__
    warnings.warn(
        f"fxopt optimized a {name}. If you train it with transformers.Trainer, pass "
        "callbacks=[fxopt.pretrained_checkpoints()]: Trainer saves a module that is not a "
        "PreTrainedModel as a bare state dict without config.json, and "
        f"{name}.from_pretrained on such a checkpoint builds the default {name} configuration, "
        "another model. Save the final model with trainer.model.save_pretrained(dir).",
        TrainerCheckpointWarning, stacklevel=3)


def pretrained_checkpoints() -> Any:
    """A transformers ``TrainerCallback`` that completes each checkpoint ``Trainer`` saves of an
    optimized Hugging Face model with what ``save_pretrained`` writes (``config.json``, the
    generation config, the weights as the original class saves them), so
    ``OriginalClass.from_pretrained(checkpoint_dir)`` loads it. For any other model it does
    nothing. ``Trainer(model=optimized, ..., callbacks=[pretrained_checkpoints()])``."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class PretrainedCheckpoints(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kwargs: Any) -> None:
            if isinstance(model, PretrainedInterface) and state.is_world_process_zero:
                folder = os.path.join(args.output_dir,
                                      f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
                model.save_pretrained(folder)

    return PretrainedCheckpoints()
