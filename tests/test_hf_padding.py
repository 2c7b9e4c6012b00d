"""The Hugging Face recipe as users train: padded batches from a collator, Trainer, checkpoints.

The issue: the guide optimized with ``input_ids`` and ``labels`` only; the first batch of a
``DataCollatorWithPadding`` carries an ``attention_mask``, which the optimized module refused
with a hint naming an internal function. The recipe now passes a batch as the collator makes it
(``docs/guide.md``), and a call with arguments the capture did not have says which to add to
``example_kwargs``.

The Trainer test follows only README + guide: a word-level tokenizer built in memory (nothing
downloads), ``DataCollatorWithPadding`` with ``-100`` labels on the padding, 12 examples of 3 to
13 tokens (every batch padded to another length), a tiny Llama optimized at ``"min"`` with the
first batch, trained 3 SGD steps by ``Trainer`` beside the un-optimized twin, the checkpoint
reloaded with ``LlamaForCausalLM.from_pretrained``. SGD, not Trainer's AdamW: the optimized
backward may add a gradient's contributions in another order (the ``"min"`` plan follows times
measured on the machine), and AdamW turns a rounding difference in a near-zero gradient into an
update of up to its learning rate (3.5e-6 seen here); SGD keeps it a rounding difference, so
parameters compare at rtol 1e-5, atol 1e-6.
"""

import copy
import warnings

import pytest
import torch

import fxopt

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB, BATCH, STEPS = 64, 2, 3
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def tokenizer():
    words = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>",
                                                unk_token="<unk>")


def texts() -> list[str]:
    generator = torch.Generator().manual_seed(3)
    lengths = [3, 9, 5, 13, 4, 7, 11, 6, 8, 3, 10, 12]
    return [" ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=generator))
            for n in lengths]


def collator(tok):
    """The guide's collator: DataCollatorWithPadding, labels = input_ids with -100 on padding."""
    pad = transformers.DataCollatorWithPadding(tok)

    def collate(features):
        batch = pad(features)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    return collate


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        use_cache=False, pad_token_id=0))


def train(model, tok, dataset, output_dir, **extra):
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=BATCH, learning_rate=1e-2,
        max_steps=STEPS, save_steps=STEPS, logging_steps=1, seed=0, report_to=[], use_cpu=True,
        disable_tqdm=True, optim="sgd")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                   data_collator=collator(tok), **extra)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_padded_batches_trains_and_reloads_like_the_original(tmp_path):
    transformers.logging.set_verbosity_error()
    tok = tokenizer()
    dataset = [tok(text) for text in texts()]
    model = llama()
    twin = copy.deepcopy(model)
    batch = collator(tok)(dataset[:BATCH])  # the first batch, as the collator makes it
    assert (batch["attention_mask"] == 0).any() and (batch["labels"] == -100).any()
    slim = fxopt.optimize(model, (), example_kwargs=dict(batch), memory_budget="min")

    # every batch of another length and padding computes the original's loss
    for start in range(0, len(dataset), BATCH):
        other = collator(tok)(dataset[start:start + BATCH])
        torch.testing.assert_close(slim(**other).loss, twin(**other).loss, **LOSS_TOLERANCE)

    expected = train(twin, tok, dataset, tmp_path / "original")
    losses = train(slim, tok, dataset, tmp_path / "optimized",
                   callbacks=[fxopt.pretrained_checkpoints()])
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **LOSS_TOLERANCE)

    loaded = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "optimized" / f"checkpoint-{STEPS}")
    assert type(loaded) is transformers.LlamaForCausalLM
    assert loaded.config.hidden_size == 16  # the model trained, not a default configuration
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[name], **PARAM_TOLERANCE)
    final = collator(tok)(dataset[-BATCH:])
    torch.testing.assert_close(loaded(**final).loss, twin(**final).loss, **LOSS_TOLERANCE)


@pytest.fixture(scope="module")
def without_mask():
    """Optimized as the old guide did: input_ids and labels, no attention_mask; with the
    warnings optimize gave."""
    transformers.logging.set_verbosity_error()
    tok = tokenizer()
    ids = torch.tensor([tok(texts()[1])["input_ids"]] * BATCH)
    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter("always")
        slim = fxopt.optimize(llama(), (), example_kwargs={"input_ids": ids, "labels": ids},
                              verify=False, predict_memory=False)
    return slim, ids, given


def test_a_call_with_an_argument_the_capture_had_not_says_which_to_add(without_mask):
    slim, ids, _ = without_mask
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    with pytest.raises(fxopt.InputError) as caught:
        slim(input_ids=ids, labels=ids, attention_mask=mask)
    message = str(caught.value)
    assert "attention_mask" in message
    assert "example_kwargs={..., 'attention_mask': ...}" in message
    assert "capture_with_export" not in message  # no internal function to call


def test_optimizing_a_pretrained_model_says_what_trainer_needs(without_mask):
    """Trainer saves a module that is not a PreTrainedModel as a bare state dict, which
    from_pretrained reads with a default (7B) configuration: optimize says so at once."""
    _, _, given = without_mask
    said = [str(w.message) for w in given
            if issubclass(w.category, fxopt.integrations.hf_trainer.TrainerCheckpointWarning)]
    assert len(said) == 1 and "callbacks=[fxopt.pretrained_checkpoints()]" in said[0], said
