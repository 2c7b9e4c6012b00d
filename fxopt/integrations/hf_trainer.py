"""What the optimized module of a Hugging Face model keeps of the model's interface, for trainers.

Trainers read more off a model than its ``forward``: Hugging Face's ``Trainer`` reads ``config``
(and sets ``config.use_cache``), ``accepts_loss_kwargs`` or forward's signature, ``loss_type``,
``main_input_name``, ``num_parameters``, ``_keys_to_ignore_on_save`` and ``_get_name()``, and
calls ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` when asked to,
and ``tie_weights`` after loading a checkpoint without the tied keys; scripts call
``save_pretrained`` and reach for the embeddings (``get_output_embeddings``,
``set_input_embeddings``). The optimized module is a GraphModule, so for a transformers
``PreTrainedModel`` fxopt gives it ``PretrainedInterface``: exactly the names in ``DELEGATED``,
each answered from the original model or from the optimized module's live state, and the names in
``REFUSED``, each raising an fxopt error that says why. Nothing else falls through to the
original: any other name is an ``AttributeError``, as on any module, so no method of the original
ever runs on state the optimized module no longer uses (``tests/test_trainers.py`` checks the
class defines these names and no others).

Where the answers come from: ``keep_pretrained_interface(gm, model, args)`` keeps a *stand-in*
of the original, a structural copy of its module tree whose parameters and buffers are
zero-size-cost meta tensors, with deep copies of ``config`` and ``generation_config``. It
holds no weights and no reference to the user's model, so replacing or sharding the optimized
module's parameters frees the originals. ``refuse_changed_config`` refuses a call after a
change of the stand-in's config that the graph, captured under the old one, would not follow. ``save_pretrained`` runs the original class's ``save_pretrained`` on the
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
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxopt.core.errors import ConfigError, ExportError, InputError
from fxopt.core.modules import UNSET, deepcopy_keeping_hooks, structural_copy
from fxopt.core.torch_private import (
    MODULE_NAME_METHOD,
    FakeTensorMode,
    derive_instance_class,
    quiet_fake_tensor_logs,
)

_STAND_IN = "_fxopt_pretrained"
# On the stand-in: what ``refuse_changed_config`` compares the config with (``_ConfigSeen``)
_CONFIG_SEEN = "_fxopt_config_seen"

# Config fields that record where a checkpoint came from, which no forward reads
# (save_pretrained writes dtype and architectures on the stand-in's config itself).
_RECORDS = frozenset({"architectures", "dtype", "torch_dtype", "transformers_version",
                      "name_or_path"})

# The special tokens Trainer aligns with its tokenizer (transformers.trainer_utils
# .align_special_tokens): read by a sequence classifier's or an encoder-decoder's forward, not by
# most causal LMs', so compared only where a run of the forward read them.
_ALIGNED_TOKENS = frozenset({"pad_token_id", "bos_token_id", "eos_token_id"})


@dataclass
class _ConfigSeen:
    """``captured``: the config's fields when the graph was made; ``agreed``: those a call last
    found to agree with them; ``unread``: aligned token fields the forward did not read."""

    captured: dict[str, Any]
    agreed: dict[str, Any]
    unread: frozenset[str]

# Each name the optimized module of a Hugging Face model answers, and who reads it and why.
DELEGATED: dict[str, str] = {
    "config": "Trainer reads it and sets config.use_cache; save_pretrained writes it as "
              "config.json (a deep copy of the original's: the user's model is not changed, and "
              "the graph, captured under the original config, does not read it: a call after "
              "a field its forward reads changed is refused, refuse_changed_config)",
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
    "tie_weights": "Trainer calls it after loading a checkpoint that lacks the tied keys: the "
                   "optimized module's parameters are the objects the model tied, so it ties "
                   "nothing again; where a tie was broken since, it is refused",
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
    "get_output_embeddings": "hooks on the head do not fire where the optimized graph does not "
                             "call it (the chunked loss reads its weight)",
    "set_input_embeddings": "the optimized graph runs the embedding as it was captured, not a "
                            "module put in its place",
    "set_output_embeddings": "the optimized graph runs the head as it was captured, not a "
                             "module put in its place",
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

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        broken = next((names for names in _ties(self._fxopt_stand_in())
                       if len({id(self.get_parameter(n)) for n in names}) > 1), None)
        if broken is not None:
            name = self._get_name()
            raise ConfigError(
                f"{' and '.join(broken)} of the optimized {name} were one Parameter when it was "
                "optimized and are not now: its graph reads each by name, and tie_weights does "
                "not tie parameters again on a module whose embeddings it cannot reach",
                where=f"{name}.tie_weights", hint=f"assign {broken[0]} to "
                f"{', '.join(broken[1:])} again (the one Parameter), or tie them on your model "
                "and optimize it")

    def get_input_embeddings(self) -> None:
        self._fxopt_refuse_embedding_hooks("get_input_embeddings")

    def get_output_embeddings(self) -> None:
        self._fxopt_refuse_embedding_hooks("get_output_embeddings")

    def set_input_embeddings(self, value: nn.Module) -> None:
        self._fxopt_refuse_new_embeddings("set_input_embeddings")

    def set_output_embeddings(self, value: nn.Module) -> None:
        self._fxopt_refuse_new_embeddings("set_output_embeddings")

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

    def _fxopt_refuse_new_embeddings(self, method: str) -> None:
        name = self._get_name()
        raise ConfigError(
            f"the optimized {name} cannot take new embeddings: its graph runs the embedding and "
            "the head as they were captured, not modules put in their place",
            where=f"{name}.{method}",
            hint="set them on the original model, then optimize it; to train with other "
                 "weights, load them into the optimized module (load_state_dict)")

    def __deepcopy__(self, memo: dict) -> fx.GraphModule:
        base = super().__deepcopy__  # the instance class's own (hooks kept, eval graph), except
        # on a copy, whose class torch.fx derives from this one alone: then the hooks' keeper
        plain = getattr(base, "__func__", None) is fx.GraphModule.__deepcopy__
        copied = deepcopy_keeping_hooks(self, memo) if plain else base(memo)
        object.__setattr__(copied, _STAND_IN, copy.deepcopy(self.__dict__[_STAND_IN], memo))
        return copied


def _ties(module: nn.Module) -> list[tuple[str, ...]]:
    """The names of each Parameter ``module`` holds under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def is_pretrained_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers:
    a model of that class means it is imported already)."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None)
    return pretrained is not None and isinstance(model, pretrained)


def keep_pretrained_interface(gm: fx.GraphModule, model: nn.Module, args: tuple) -> None:
    """Give ``gm``, the optimized module of ``model``, the interface in DELEGATED and REFUSED when
    ``model`` is a transformers ``PreTrainedModel`` or an optimized one (optimized again); any
    other model is left alone.

    ``gm``'s class becomes a subclass of its own class and of ``PretrainedInterface`` (torch.fx
    gives every GraphModule a class of its own), so its forward and anything set on its class
    stay; deep copies and fxopt's structural copies keep the interface. ``args``: the example
    inputs, bound to forward's parameters (what ``refuse_changed_config`` learns the special
    tokens' use from).
    """
    if isinstance(gm, PretrainedInterface):
        return
    if isinstance(model, PretrainedInterface):  # its graph still has the first config built in
        stand_in = copy.deepcopy(model._fxopt_stand_in())
    elif is_pretrained_model(model):
        stand_in = _stand_in(model)
        captured = copy.deepcopy(vars(stand_in.config))
        read = config_fields_read(model, args)
        unread = _ALIGNED_TOKENS - read if read is not None else frozenset()
        stand_in.__dict__[_CONFIG_SEEN] = _ConfigSeen(captured, captured, unread)
    else:
        return
    object.__setattr__(gm, _STAND_IN, stand_in)
    # Its __name__ stays the model's (LlamaForCausalLM): what an export names its class and a
    # repr shows.
    derive_instance_class(gm, PretrainedInterface)


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


def refuse_changed_config(gm: nn.Module) -> None:
    """``ConfigError`` when a field of the ``config`` of the optimized module of a Hugging Face
    model that its forward may read holds another value than when the graph was captured.

    The graph computes what the forward computed under the config of that time, and never reads
    the config again: ``output_hidden_states``, ``use_cache``, ``problem_type`` (which loss),
    ``id2label`` (how many labels), ``pad_token_id`` (which token a sequence classifier pools,
    what an encoder-decoder shifts its labels with) are built in. The original reads its config
    on every call, so the same assignment on both would change the original's results only: the
    call is refused before any compute, naming the field. Which fields a forward reads, the
    graph does not say, so every public field counts but:

    - those that record a checkpoint's origin (``_RECORDS``; ``save_pretrained`` writes
      ``dtype`` and ``architectures``);
    - ``use_cache`` switched off, as ``Trainer`` does: a capture refuses a returned cache, so
      the graph makes none;
    - the special tokens ``Trainer`` aligns with its tokenizer (``_ALIGNED_TOKENS``) where a run
      of the forward on fake tensors did not read them (``config_fields_read``: a causal LM's
      ``pad_token_id``).

    A private field is compared under the name of the property that stores it
    (``_output_attentions``), and not at all otherwise (the attention implementation, which
    computes the same function). A call whose config equals what the last call found to agree
    costs one comparison of two dicts. Not seen: a change inside an object the config holds
    that still compares equal to its copy (plain values, lists, dicts and sub-configs compare
    by value)."""
    stand_in = gm.__dict__.get(_STAND_IN)
    seen = None if stand_in is None else stand_in.__dict__.get(_CONFIG_SEEN)
    if seen is None:
        return
    config = stand_in.config
    now = vars(config)
    if now == seen.agreed:
        return
    read = []
    for key in sorted(now.keys() | seen.captured.keys()):
        value, was = now.get(key, UNSET), seen.captured.get(key, UNSET)
        name = _public_name(type(config), key)
        if name is None or name in _RECORDS or name in seen.unread or value == was:
            continue
        if name == "use_cache" and (value is UNSET or not value):
            continue
        read.append((name, was, value))
    if not read:
        seen.agreed = copy.deepcopy(now)
        return
    name, was, value = read[0]
    model = type(stand_in).__name__
    others = f" (and {', '.join(n for n, *_ in read[1:])})" if read[1:] else ""
    raise ConfigError(
        f"config.{name}{others} of the optimized {model} is {value!r} now, where fxopt.optimize "
        f"captured it under {was!r}: the optimized graph computes what the forward computed with "
        "the config of that time and never reads config again, so the same change would change "
        "your model's results and not these",
        where=f"{model}.config.{name}",
        hint=f"set config.{name} on your model before fxopt.optimize (or pass it to forward in "
             f"example_kwargs where forward takes it), or set it back to {was!r} here")


def config_fields_read(model: nn.Module, args: tuple) -> frozenset[str] | None:
    """The names ``model``'s forward reads off its configs, found by running it in train and in
    eval mode on fake tensors shaped like ``args``: a stand-in's copy (``_stand_in``, meta
    parameters) whose modules hold a recording copy of each config, so the user's model and
    configs are not touched and no arithmetic runs. None when a run fails (a forward that reads
    tensor values, which fake tensors do not have): then every field counts as read.

    Not seen: a field read only on another device's branch (``if x.is_cuda``) or only while
    ``torch.compile`` traces; ``refuse_changed_config`` asks this of the special tokens alone."""
    probe = _stand_in(model)
    read: set[str] = set()
    recording: dict[int, Any] = {}
    for module in probe.modules():
        for key, value in list(vars(module).items()):
            if _is_config(value):
                if id(value) not in recording:
                    recording[id(value)] = _recording(value, read)
                module.__dict__[key] = recording[id(value)]
    try:
        with warnings.catch_warnings(), quiet_fake_tensor_logs(), \
                FakeTensorMode(allow_non_fake_inputs=True) as fake:
            warnings.simplefilter("ignore")
            inputs = tuple(fake.from_tensor(torch.empty_like(a, device="meta"))
                           if isinstance(a, torch.Tensor) else a for a in args)
            for training in (True, False):
                probe.train(training)
                probe(*inputs)
    except Exception:  # noqa: BLE001 -- any failure only means "unknown": count every field
        return None
    return frozenset(read)


def _is_config(value: Any) -> bool:
    transformers = sys.modules.get("transformers")
    config = getattr(transformers, "PretrainedConfig", None)
    return config is not None and isinstance(value, config)


def _recording(config: Any, read: set[str]) -> Any:
    """A deep copy of ``config`` of a subclass that adds each name read off it to ``read``."""
    base = type(config)

    def __getattribute__(self: Any, name: str) -> Any:
        read.add(name)
        return base.__getattribute__(self, name)

    copied = copy.deepcopy(config)
    copied.__class__ = type(base.__name__, (base,), {"__getattribute__": __getattribute__})
    return copied


def _public_name(config_class: type, key: str) -> str | None:
    """The name a script sets ``key`` of a config's ``__dict__`` by: the key itself, the
    property a private key stores (``_output_attentions``), or None for another private key."""
    if not key.startswith("_"):
        return key
    return key[1:] if isinstance(getattr(config_class, key[1:], None), property) else None


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
