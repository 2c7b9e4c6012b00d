"""Trainers train an optimized Hugging Face causal LM as they train the original (issue 23, item 4).

Hugging Face's ``Trainer`` and ``accelerate``'s ``Accelerator.prepare`` run 3 AdamW steps on an
export-captured tiny Llama (random init, ``memory_budget="min"``, so backward recomputes checkpoint
regions) and on the original, on CPU over one in-memory dataset. Tolerances: the losses agree to
float32 rounding (rtol 1e-6; bit-equal on torch 2.14) and the parameters after 3 steps to rtol
1e-5, atol 1e-6: the optimized module runs the same ATen ops, but its backward may add up the
gradient contributions to one tensor in another order than eager Hugging Face code, and AdamW
turns a rounding difference in a near-zero gradient into an update of up to ``lr`` (1.3e-7 seen at
lr 1e-2). Anything the optimized module does against itself (resuming, reloading) is bit-exact.
``verify=False`` when optimizing: these comparisons with the original are the check.

What a trainer reads off the model is ``fxopt.integrations.hf_trainer``'s DELEGATED and REFUSED
lists.
"""

import copy
import inspect
import json

import pytest
import torch
from torch import nn

import fxopt
from helpers import FailAt
from fxopt.integrations.hf_trainer import (
    DELEGATED,
    REFUSED,
    PretrainedInterface,
    pretrained_checkpoints,
)

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 2, 3, 1e-2
LOSS_TOLERANCE = {"rtol": 1e-6, "atol": 0.0}
PARAM_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def llama() -> "transformers.LlamaForCausalLM":
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
        use_cache=False))


def dataset() -> list[dict]:
    """8 examples of token ids with labels, and a column no forward takes (Trainer drops it by
    forward's signature)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(8):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone(), "example_id": i})
    return rows


@pytest.fixture(scope="module")
def optimized():
    """The optimized tiny Llama and its initial weights (each test starts from them)."""
    transformers.logging.set_verbosity_error()
    ids = torch.stack([row["input_ids"] for row in dataset()[:BATCH]])
    gm = fxopt.optimize(llama(), (), example_kwargs={"input_ids": ids, "labels": ids},
                        memory_budget="min", verify=False, predict_memory=False)
    assert gm.fxopt_report.trace.frontend == "export"
    assert isinstance(gm, PretrainedInterface)
    return gm, {name: t.clone() for name, t in gm.state_dict().items()}


def fresh(optimized):
    gm, initial = optimized
    gm.load_state_dict(initial)
    for p in gm.parameters():
        p.grad = None
    return gm


def assert_same_parameters(got: dict, expected: dict, **tolerance) -> None:
    assert got.keys() == expected.keys()
    for name, value in got.items():
        if tolerance:
            torch.testing.assert_close(value, expected[name], **tolerance,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(value, expected[name]), name


def state_of(module: nn.Module) -> dict:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


# Hugging Face Trainer


def train_with_trainer(model, output_dir, *, resume_from=None, **arguments):
    arguments = {"max_steps": STEPS, "save_steps": 2, **arguments}
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=BATCH, learning_rate=LR,
        logging_steps=1, seed=0, report_to=[], use_cpu=True, disable_tqdm=True, **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   callbacks=[pretrained_checkpoints()])
    trainer.train(resume_from_checkpoint=resume_from)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return trainer, losses


def read_json(path) -> dict:
    return json.loads(path.read_text())


def test_trainer_trains_saves_and_resumes_like_the_original(optimized, tmp_path):
    original = llama()
    reference, expected = train_with_trainer(original, tmp_path / "original")
    gm = fresh(optimized)
    trainer, losses = train_with_trainer(gm, tmp_path / "optimized")

    assert list(losses) == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(list(losses.values())),
                               torch.tensor(list(expected.values())), **LOSS_TOLERANCE)
    trained = state_of(gm)
    assert_same_parameters(trained, state_of(original), **PARAM_TOLERANCE)
    # num_parameters is delegated: the same floating point operation count
    assert trainer.state.total_flos == reference.state.total_flos > 0

    # every checkpoint loads into the original class; the last one holds the final weights
    for step in (2, 3):
        folder = tmp_path / "optimized" / f"checkpoint-{step}"
        theirs = tmp_path / "original" / f"checkpoint-{step}"
        for name in ("config.json", "generation_config.json"):
            assert read_json(folder / name) == read_json(theirs / name), name
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "optimized" / "checkpoint-3")
    assert type(loaded) is transformers.LlamaForCausalLM
    assert_same_parameters(state_of(loaded), trained)

    # resuming from step 2 repeats step 3 exactly
    _, resumed = train_with_trainer(gm, tmp_path / "optimized",
                                    resume_from=str(tmp_path / "optimized" / "checkpoint-2"))
    assert resumed == losses
    assert_same_parameters(state_of(gm), trained)


def test_trainer_label_smoothing_shifts_the_labels_of_the_optimized_causal_lm(tmp_path):
    """With label smoothing Trainer takes the labels out and computes the loss from the logits,
    shifting them for models whose class name is a causal LM's (``_get_name`` is delegated). A
    module captured without labels has no ``labels`` parameter, from which Trainer would find its
    label names, so they are given."""
    ids = torch.stack([row["input_ids"] for row in dataset()[:BATCH]])
    gm = fxopt.optimize(llama(), (), example_kwargs={"input_ids": ids}, memory_budget="min",
                        verify=False, predict_memory=False)
    smoothing = {"label_smoothing_factor": 0.1, "max_steps": 2, "save_strategy": "no",
                 "label_names": ["labels"]}
    _, expected = train_with_trainer(llama(), tmp_path / "original", **smoothing)
    _, losses = train_with_trainer(gm, tmp_path / "optimized", **smoothing)
    assert list(losses) == [1, 2]
    torch.testing.assert_close(torch.tensor(list(losses.values())),
                               torch.tensor(list(expected.values())), **LOSS_TOLERANCE)


# accelerate


@pytest.mark.parametrize("optimized_under_autocast", [True, False], ids=["inside", "outside"])
def test_trainer_bf16_trains_a_llama_optimized_inside_autocast_and_refuses_one_optimized_outside(
        optimized_under_autocast, tmp_path):
    """``bf16=True`` runs the forward under bfloat16 autocast. The guide's recipe, ``optimize``
    inside that autocast, trains 3 steps with the original's losses; optimized outside it, the
    export-captured Llama failed mid-step with torch's bare "Tensor dtype mismatch" and is now
    refused at its first call with an ``InputError`` saying where to call ``optimize``."""
    ids = torch.stack([row["input_ids"] for row in dataset()[:BATCH]])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=optimized_under_autocast):
        gm = fxopt.optimize(llama(), (), example_kwargs={"input_ids": ids, "labels": ids},
                            memory_budget="min")
    arguments = {"bf16": True, "save_strategy": "no", "optim": "sgd"}
    try:
        if not optimized_under_autocast:
            with pytest.raises(fxopt.InputError, match="captured by torch.export in full "
                                                       "precision, and this call runs under "
                                                       "bfloat16 autocast"):
                train_with_trainer(gm, tmp_path / "optimized", **arguments)
            return
        _, expected = train_with_trainer(llama(), tmp_path / "original", **arguments)
        _, losses = train_with_trainer(gm, tmp_path / "optimized", **arguments)
    finally:
        # accelerate keeps one process-wide state: every later Accelerator(cpu=True) of this
        # worker would be bf16 too
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(list(losses.values())),
                               torch.tensor(list(expected.values())), **LOSS_TOLERANCE)


def train_with_accelerate(model, folder, *, steps=range(STEPS), resume_from=None, prepared=None):
    """``steps`` AdamW steps of a plain accelerate loop; saves the accelerator state after step 2
    (index 1) to ``folder/state``. Returns the losses and what was prepared (to resume)."""
    if prepared is None:
        accelerator = accelerate.Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(
            [{k: row[k] for k in ("input_ids", "labels")} for row in dataset()],
            batch_size=BATCH, shuffle=False)
        prepared = (accelerator, *accelerator.prepare(model, optimizer, loader))
    accelerator, model, optimizer, loader = prepared
    if resume_from is not None:
        accelerator.load_state(resume_from)
    batches = list(loader)
    losses = {}
    model.train()
    for step in steps:
        loss = model(**batches[step]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step + 1] = loss.item()
        if step == 1 and resume_from is None:
            accelerator.save_state(str(folder / "state"))
    return losses, prepared


def test_accelerate_prepare_trains_saves_and_resumes_like_the_original(optimized, tmp_path):
    original = llama()
    expected, _ = train_with_accelerate(original, tmp_path / "original")
    gm = fresh(optimized)
    losses, prepared = train_with_accelerate(gm, tmp_path / "optimized")

    torch.testing.assert_close(torch.tensor(list(losses.values())),
                               torch.tensor(list(expected.values())), **LOSS_TOLERANCE)
    trained = state_of(gm)
    assert_same_parameters(trained, state_of(original), **PARAM_TOLERANCE)

    accelerator = prepared[0]
    unwrapped = accelerator.unwrap_model(prepared[1])
    assert unwrapped is gm
    unwrapped.save_pretrained(tmp_path / "final", is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "final")
    assert_same_parameters(state_of(loaded), trained)

    # back to the state saved after step 2; step 3 again gives the same loss and weights
    resumed, _ = train_with_accelerate(gm, tmp_path / "optimized", steps=[2], prepared=prepared,
                                       resume_from=str(tmp_path / "optimized" / "state"))
    assert resumed == {3: losses[3]}
    assert_same_parameters(state_of(gm), trained)


# What a trainer reads off the model


def test_the_interface_is_exactly_the_named_lists():
    """No name of the original falls through by accident: the class defines what DELEGATED and
    REFUSED list (and its own helpers), nothing else."""
    own = {name for name in vars(PretrainedInterface)
           if not (name.startswith("__") or name.startswith("_fxopt_"))}
    assert own == DELEGATED.keys() | REFUSED.keys()
    assert not DELEGATED.keys() & REFUSED.keys()


def test_what_trainer_reads_is_the_originals_or_the_live_modules(optimized):
    gm, original = fresh(optimized), llama()
    assert gm.config is not original.config  # a copy: Trainer's config.use_cache = ... stays ours
    written = {"dtype", "architectures"}  # what save_pretrained sets, on the original's too
    assert ({k: v for k, v in gm.config.to_dict().items() if k not in written}
            == {k: v for k, v in original.config.to_dict().items() if k not in written})
    assert gm.generation_config.to_dict() == original.generation_config.to_dict()
    gm.config.use_cache = True
    assert original.config.use_cache is False
    gm.config.use_cache = False
    for name in ("main_input_name", "loss_type", "_keys_to_ignore_on_save"):
        assert getattr(gm, name) == getattr(original, name), name
    assert gm._get_name() == "LlamaForCausalLM"
    assert gm.accepts_loss_kwargs is False and gm.can_generate() is False
    for flags in [{}, {"exclude_embeddings": True}, {"only_trainable": True}]:
        assert gm.num_parameters(**flags) == original.num_parameters(**flags), flags
    gm.lm_head.weight.requires_grad_(False)
    try:  # live: a frozen parameter is not trainable any more
        assert gm.num_parameters(only_trainable=True) == (
            original.num_parameters() - gm.lm_head.weight.numel())
    finally:
        gm.lm_head.weight.requires_grad_(True)
    # Trainer's column pruning and label names come from forward's signature
    parameters = inspect.signature(gm.forward).parameters
    assert {"input_ids", "labels", "attention_mask"} <= parameters.keys()
    assert transformers.utils.find_labels(type(gm)) == ["labels"]


# What the graph has built in of the config

def batch_ids() -> torch.Tensor:
    return torch.stack([row["input_ids"] for row in dataset()[:BATCH]])


@pytest.mark.parametrize("name, value, shows", [
    ("output_hidden_states", True, lambda out: out.hidden_states is not None),
    ("use_cache", True, lambda out: out.past_key_values is not None),
])
def test_a_config_field_the_forward_reads_set_anew_is_refused_before_any_compute(
        optimized, name, value, shows):
    """The graph computes what the forward computed under the config it was captured with; set
    anew, the field changes the original's results, so the optimized module's call raises naming
    it, before any ATen call; put back, the call runs and computes the original's loss."""
    gm, original, ids = copy.deepcopy(fresh(optimized)), llama(), batch_ids()
    was = getattr(gm.config, name)
    setattr(original.config, name, value)
    assert shows(original(input_ids=ids, labels=ids))
    setattr(gm.config, name, value)
    with FailAt() as ops, pytest.raises(fxopt.ConfigError,
                                        match=rf"config\.{name} of the optimized LlamaForCausalLM "
                                              rf"is {value!r} now, where .* under {was!r}"):
        gm(input_ids=ids, labels=ids)
    assert ops.calls == 0
    setattr(gm.config, name, was)
    setattr(original.config, name, was)
    torch.testing.assert_close(gm(input_ids=ids, labels=ids).loss,
                               original(input_ids=ids, labels=ids).loss, **LOSS_TOLERANCE)


def test_config_fields_no_forward_reads_may_change(optimized, tmp_path):
    """What Trainer and save_pretrained set: use_cache off, dtype and architectures (written by
    save_pretrained), and special tokens this causal LM's forward does not read (Trainer aligns
    them with its tokenizer: the original's loss does not move); a private field is not
    compared. Each call still computes the original's loss."""
    gm, original, ids = copy.deepcopy(fresh(optimized)), llama(), batch_ids()
    expected = original(input_ids=ids, labels=ids).loss
    original.config.pad_token_id, original.config.eos_token_id = 5, 6
    torch.testing.assert_close(original(input_ids=ids, labels=ids).loss, expected, rtol=0, atol=0)
    gm.save_pretrained(tmp_path)
    gm.config.use_cache = False
    gm.config.pad_token_id, gm.config.eos_token_id, gm.config.bos_token_id = 5, 6, 7
    gm.config._fxopt_private_note = "not compared"
    torch.testing.assert_close(gm(input_ids=ids, labels=ids).loss, expected, **LOSS_TOLERANCE)
    gm.config.output_hidden_states = True  # still compared after the accepted changes
    with pytest.raises(fxopt.ConfigError, match=r"config\.output_hidden_states"):
        gm(input_ids=ids, labels=ids)


def test_a_special_token_the_forward_reads_is_refused():
    """A sequence classifier pools the last token that is not ``pad_token_id``: set anew, it moves
    the original's logits, so the optimized module refuses the call; the other special tokens,
    which its forward does not read, may change."""
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
        use_cache=False, pad_token_id=0, num_labels=2)).train()
    ids = batch_ids()
    ids[0, -3:] = 0
    labels = torch.tensor([0, 1])
    gm = fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": labels},
                        verify=False, predict_memory=False)
    before = model(input_ids=ids, labels=labels).logits
    gm.config.eos_token_id = 9
    torch.testing.assert_close(gm(input_ids=ids, labels=labels).logits, before, **LOSS_TOLERANCE)
    model.config.pad_token_id = gm.config.pad_token_id = 5
    assert not torch.allclose(model(input_ids=ids, labels=labels).logits, before)
    with pytest.raises(fxopt.ConfigError, match=r"config\.pad_token_id .* is 5 now"):
        gm(input_ids=ids, labels=labels)


def test_a_copy_and_its_original_check_their_own_configs(optimized):
    gm = copy.deepcopy(fresh(optimized))
    copied = copy.deepcopy(gm)
    copied.config.output_hidden_states = True
    ids = batch_ids()
    gm(input_ids=ids, labels=ids)
    with pytest.raises(fxopt.ConfigError, match="output_hidden_states"):
        copied(input_ids=ids, labels=ids)
    gm.config = copy.deepcopy(copied.config)  # a config replaced whole is compared as well
    with pytest.raises(fxopt.ConfigError, match="output_hidden_states"):
        gm(input_ids=ids, labels=ids)


def test_refused_methods_say_why(optimized, tmp_path):
    gm = fresh(optimized)
    for method in ("gradient_checkpointing_enable", "gradient_checkpointing_disable",
                   "activation_checkpointing_enable", "activation_checkpointing_disable"):
        with pytest.raises(fxopt.ConfigError, match="already plans activation checkpointing"):
            getattr(gm, method)()
    with pytest.raises(fxopt.InputError, match="cannot generate"):
        gm.generate(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(fxopt.InputError, match="cannot resize"):
        gm.resize_token_embeddings(VOCAB + 8)
    for method in ("get_input_embeddings", "get_output_embeddings",
                   "enable_input_require_grads"):
        with pytest.raises(fxopt.InputError, match="embedding module"):
            getattr(gm, method)()
    for method in ("set_input_embeddings", "set_output_embeddings"):
        with pytest.raises(fxopt.ConfigError, match="cannot take new embeddings") as caught:
            getattr(gm, method)(nn.Embedding(VOCAB, 16))
        assert caught.value.where == f"LlamaForCausalLM.{method}"
    # as Trainer asks for it, before any step
    with pytest.raises(fxopt.ConfigError, match="memory_budget"):
        train_with_trainer(gm, tmp_path, activation_checkpointing=True)
    with pytest.raises(fxopt.InputError, match="NEFTune"):
        train_with_trainer(gm, tmp_path, neftune_noise_alpha=5.0)
    assert state_of(gm).keys() == optimized[1].keys()
    assert_same_parameters(state_of(gm), optimized[1])


def test_tie_weights_keeps_the_ties_and_refuses_one_broken_since():
    """Trainer calls ``tie_weights()`` after loading a checkpoint without the tied keys; on the
    optimized module it raised AttributeError. Its parameters are the objects the model tied,
    so it ties nothing again and the module computes as before; a tie broken since (a new
    Parameter at one of the names) is refused, naming both, and put back it passes again."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, use_cache=False,
        tie_word_embeddings=True))
    ids = batch_ids()
    gm = fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                        verify=False, predict_memory=False)
    assert gm.lm_head.weight is gm.model.embed_tokens.weight
    before = gm(input_ids=ids, labels=ids).loss
    assert gm.tie_weights() is None
    assert gm.lm_head.weight is model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(gm(input_ids=ids, labels=ids).loss, before, rtol=0, atol=0)
    tied = gm.lm_head.weight
    gm.lm_head.weight = nn.Parameter(tied.detach().clone())
    with pytest.raises(fxopt.ConfigError, match="model.embed_tokens.weight and lm_head.weight "
                                               "of the optimized LlamaForCausalLM were one "
                                               "Parameter") as caught:
        gm.tie_weights()
    assert caught.value.where == "LlamaForCausalLM.tie_weights"
    gm.lm_head.weight = tied
    gm.tie_weights()


def test_save_pretrained_saves_the_live_state(optimized, tmp_path):
    """After load_state_dict(assign=True) the module computes with new tensors; save_pretrained
    saves those, under the original's keys, and the stand-in keeps no weights alive."""
    gm = fresh(optimized)
    replaced = {name: t * 2 for name, t in optimized[1].items()}
    gm.load_state_dict(replaced, assign=True)
    try:
        gm.save_pretrained(tmp_path)
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
        assert_same_parameters(state_of(loaded), replaced)
        stand_in = gm.__dict__["_fxopt_pretrained"]
        assert {t.device.type for t in stand_in.state_dict().values()} == {"meta"}
    finally:
        gm.load_state_dict({name: t.clone() for name, t in optimized[1].items()}, assign=True)


def test_copies_keep_the_interface_and_other_models_get_none(optimized):
    gm = fresh(optimized)
    copied = copy.deepcopy(gm)
    assert isinstance(copied, PretrainedInterface) and copied._get_name() == "LlamaForCausalLM"
    assert copied.config is not gm.config and copied.config.to_dict() == gm.config.to_dict()
    ids = torch.stack([row["input_ids"] for row in dataset()[:BATCH]])
    assert torch.equal(copied(input_ids=ids, labels=ids).loss, gm(input_ids=ids, labels=ids).loss)

    plain = fxopt.optimize(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4))
    assert not isinstance(plain, PretrainedInterface) and not hasattr(plain, "config")
