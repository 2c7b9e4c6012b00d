"""An export-captured module serves the shapes and refuses the dtypes it was not captured for.

Sizes (issue 22, item 3): ``fxopt.capture.export_frontend`` exports every dimension of every
tensor input as dynamic, and a batch of 1 through a second trace (``fxopt.capture.export_guards``):
a training loop with dynamic padding (a new length every batch, a short last batch) trains the
optimized module step for step as it trains the model. What cannot be dynamic is refused, saying
so. Dtypes (item 2): an export graph has the capture dtypes built in, so a module converted
after capture (``.half()``, ``.to(torch.bfloat16)``, ``.double()``) is refused by its input guard
before it computes anything; an fx-captured module computes in the dtype it is converted to.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxopt
from fxopt.capture.export_frontend import capture_with_export
from fxopt.capture.export_guards import _Unsupported, parse_guard
from fxopt.runtime.input_guard import evaluate, render

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 97


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, num_labels=3, pad_token_id=0))


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512, use_cache=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))


def padded_batch(batch: int, length: int, gen: torch.Generator, classes: int | None = None
                 ) -> dict[str, torch.Tensor]:
    """A batch padded on the right to its longest row, as a dynamic-padding collator makes."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    if classes is not None:
        labels = torch.randint(0, classes, (batch,), generator=gen)
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step(module: nn.Module, batch: dict, seed: int) -> tuple[torch.Tensor, dict]:
    """One forward (dropout drawn from ``seed``) and backward; the loss and the gradients."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = module(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()
                           if p.grad is not None}


def assert_same_step(got: tuple, expected: tuple, what: str) -> None:
    torch.testing.assert_close(got[0], expected[0], msg=f"loss, {what}")
    assert got[1].keys() == expected[1].keys(), what
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], msg=f"{name}, {what}")


# -- item 3: sequence length and batch 1


@pytest.fixture(scope="module")
def captured_llama() -> tuple[nn.Module, nn.Module, dict, fx.GraphModule]:
    """A tiny Llama, its twin (a deep copy, made before any test trains the model), the example
    batch at (4, 64) and one capture of the model on it, which every Llama test of this file
    plans from (``captured=``) or reads: an export capture is three torch.export traces."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    example = padded_batch(4, 64, torch.Generator().manual_seed(0))
    return model, reference, example, fxopt.capture_model(model, (), example_kwargs=example)


@pytest.mark.parametrize("budget", [None, "min"], ids=["default", "min"])
def test_a_llama_trains_step_for_step_with_dynamic_padding(budget, captured_llama):
    """Optimized once at (4, 64); ten batches of random lengths in [17, 256], the last of one
    row: loss, every gradient and every parameter after the optimizer step equal the original's.

    SGD with momentum, not AdamW: AdamW's first steps move each weight by about lr * sign(g),
    so a gradient element that cancels to near zero (its rounding as large as itself) flips a
    weight by 2 lr when the two models sum in other orders (the chunked loss under "min" does,
    with chunks the plan sizes): that tests rounding, not the function. tests/test_fsdp.py
    judges AdamW's parameters against a float64 reference instead."""
    model, _, _, captured = captured_llama  # trained by the budget before: the same function
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    example = padded_batch(4, 64, gen)
    slim = fxopt.optimize(model, (), example_kwargs=example, memory_budget=budget,
                          captured=captured)
    assert slim.fxopt_report.trace.frontend == "export"
    info = slim.meta["fxopt_export"]
    assert {"input_ids.shape[0]", "input_ids.shape[1]", "labels.shape[1]"} <= set(info.dynamic)
    assert info.batch_of_one
    if budget is not None:
        assert next(p for p in slim.fxopt_report.passes if p.name == "checkpoint").modified

    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (slim, reference)]
    sizes = [(3, int(torch.randint(17, 257, (), generator=gen))) for _ in range(9)]
    sizes.append((1, int(torch.randint(17, 257, (), generator=gen))))
    for i, (rows, length) in enumerate(sizes):
        batch = padded_batch(rows, length, gen)
        what = f"step {i}, batch of {rows} x {length}"
        got, expected = step(slim, batch, seed=i), step(reference, batch, seed=i)
        assert_same_step(got, expected, what)
        for optimizer in optimizers:
            optimizer.step()
        for (name, p), q in zip(slim.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, msg=f"{name} after the optimizer step, {what}")


@pytest.mark.parametrize("make, classes", [(tiny_bert, 3), (tiny_gpt2, None)],
                         ids=["bert_classifier", "gpt2_lm"])
def test_an_encoder_classifier_and_gpt2_serve_batch_one_and_other_lengths(make, classes):
    model = make()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    slim = fxopt.optimize(model, (), example_kwargs=padded_batch(4, 32, gen, classes))
    assert slim.fxopt_report.trace.frontend == "export"
    assert slim.meta["fxopt_export"].batch_of_one
    for i, (rows, length) in enumerate([(1, 32), (4, 19), (2, 77), (1, 50)]):
        batch = padded_batch(rows, length, gen, classes)
        assert_same_step(step(slim, batch, seed=i), step(reference, batch, seed=i),
                         f"batch of {rows} x {length}")
    slim.eval()
    reference.eval()
    batch = padded_batch(1, 23, gen, classes)
    with torch.no_grad():
        torch.testing.assert_close(slim(**batch).logits, reference(**batch).logits)


def test_a_length_of_one_is_refused_saying_why(captured_llama):
    *_, gm = captured_llama  # the export capture at (4, 64)
    assert gm.meta["fxopt_trace"].frontend == "export"
    with pytest.raises(fxopt.InputError) as error:
        gm(**padded_batch(4, 1, torch.Generator().manual_seed(2)))
    assert error.value.where.endswith("input_ids.shape[1]")
    assert "in [2, inf]" in error.value.what and "sizes 0 and 1" in error.value.what
    assert "capture again with example inputs of this size" in error.value.hint


class BranchOnOneRow(nn.Module):
    """Takes another path for a batch of one row: a graph traced at a batch of 4 is wrong there."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if x.shape[0] == 1:
            return h * 2
        return h


def test_a_batch_of_one_the_model_treats_apart_is_refused_not_computed_wrongly():
    model, x = BranchOnOneRow(), torch.randn(4, 8)
    gm = capture_with_export(model, (x,))
    info = gm.meta["fxopt_export"]
    assert info.dynamic == ("x.shape[0]",) and not info.batch_of_one
    other = torch.randn(3, 8)  # served: any batch of 2 or more
    assert torch.equal(gm(other), model(other))
    with pytest.raises(fxopt.InputError) as error:
        gm(torch.randn(1, 8))
    assert "x.shape[0] >= 2 (forward treats a batch of 1 apart: a second trace at batch 1 " \
           "recorded a different graph); this call gives x.shape[0] = 1" in error.value.what
    with pytest.raises(fxopt.InputError, match=r"x.shape\[1\] == 8 only \(this size cannot be "
                                               r"dynamic: the model's code fixes it"):
        gm(torch.randn(4, 9))


class BranchOnOneRowInEval(BranchOnOneRow):
    """Takes another path for a batch of one row in eval mode only."""

    def forward(self, x):
        h = self.lin(x)
        if not self.training and x.shape[0] == 1:
            return h * 2
        return h


def test_a_batch_of_one_treated_apart_only_in_eval_mode_is_refused_in_eval_mode():
    """The train graph at a batch of 4 passes every batch of 1 through a second trace; the eval
    graph is not assumed to be the train graph: the size test on the eval path leaves its mark
    (the oblivious trace records it), so eval gets a graph and a second trace of its own."""
    model, x = BranchOnOneRowInEval(), torch.randn(4, 8)
    gm = capture_with_export(model, (x,))
    assert gm.meta["fxopt_trace"].mode_dependent
    one = torch.randn(1, 8)
    assert torch.equal(gm(one), model(one))  # train mode: no branch, a batch of 1 is served
    model.eval(), gm.eval()
    with torch.no_grad(), pytest.raises(fxopt.InputError, match="treats a batch of 1 apart"):
        gm(one)
    assert torch.equal(gm(x), model(x))


class DropsNothing(nn.Module):
    """``nn.Dropout(p)`` between two layers: at p 0 (the default of many models) the train-mode
    trace records ``dropout(h, 0.0, True)`` and the eval-mode one ``dropout(h, 0.0, False)``,
    both the input itself."""

    def __init__(self, p: float, branch_in_eval: bool = False):
        super().__init__()
        self.lin1, self.drop, self.lin2 = nn.Linear(8, 8), nn.Dropout(p), nn.Linear(8, 8)
        self.branch_in_eval = branch_in_eval

    def forward(self, x):
        h = self.lin2(self.drop(self.lin1(x)))
        if self.branch_in_eval and not self.training and x.shape[0] == 1:
            return h * 2
        return h


def exports_of(model: nn.Module, x: torch.Tensor, monkeypatch) -> tuple[fx.GraphModule, list]:
    """``capture_with_export(model, (x,))`` and the batch size of each torch.export trace."""
    batches, export = [], torch.export.export

    def counted(module, args, *rest, **kwargs):
        batches.append(args[0].shape[0])
        return export(module, args, *rest, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    gm = capture_with_export(model, (x,))
    assert gm.meta["fxopt_trace"].traces == gm.meta["fxopt_export"].traces == len(batches)
    return gm, batches


def test_a_dropout_that_drops_nothing_costs_no_second_trace_at_batch_one(monkeypatch):
    """The eval-mode export equals the train-mode one but for a dropout that drops nothing, so
    its batch of 1 is the train mode's, proven by the train mode's second trace: three traces,
    not four. A dropout that drops something keeps eval's own second trace."""
    x, one = torch.randn(4, 8), torch.randn(1, 8)
    gm, batches = exports_of(DropsNothing(0.0), x, monkeypatch)
    assert batches == [4, 4, 1] and gm.meta["fxopt_export"].batch_of_one
    model = DropsNothing(0.1)
    gm, batches = exports_of(model, x, monkeypatch)
    assert batches == [4, 4, 1, 1] and gm.meta["fxopt_export"].batch_of_one
    model.eval(), gm.eval()
    with torch.no_grad():
        assert torch.equal(gm(one), model(one))


def test_an_eval_only_batch_branch_is_still_refused_behind_a_dropout_that_drops_nothing(
        monkeypatch):
    model, x, one = DropsNothing(0.0, branch_in_eval=True), torch.randn(4, 8), torch.randn(1, 8)
    gm, batches = exports_of(model, x, monkeypatch)
    assert batches == [4, 4, 1, 1]  # eval's size test leaves its mark: eval traced at 1 too
    assert torch.equal(gm(one), model(one))
    model.eval(), gm.eval()
    with torch.no_grad(), pytest.raises(fxopt.InputError, match="treats a batch of 1 apart"):
        gm(one)


def test_an_export_captured_llama_has_one_graph_and_refuses_torch_save_saying_why(
        optimized_llama, captured_llama, tmp_path):
    """The train- and eval-mode exports of a Llama without dropout differ only in the names of
    their higher-order operators' bodies (``submod_1`` vs ``submod_2``), compared by graph:
    one graph serves both modes. torch.fx's pickling would re-trace the code without those
    bodies (plain attributes; the load failed with a NameError), so torch.save is a clear
    ExportError."""
    slim, _, batch = optimized_llama
    model = copy.deepcopy(captured_llama[0])  # the original as it is now (tests train it)
    assert not slim.fxopt_report.trace.mode_dependent
    with pytest.raises(fxopt.ExportError, match="higher-order operators") as info:
        torch.save(slim, tmp_path / "slim.pt")
    assert "state_dict()" in info.value.hint and "fxopt.export" in info.value.hint
    slim.eval(), model.eval()
    try:
        with torch.no_grad():
            torch.testing.assert_close(slim(**batch).logits, model(**batch).logits, rtol=0,
                                       atol=0)
    finally:  # the module fixture, as the other tests expect it
        slim.train()


def test_guards_read_as_size_expressions():
    expr = parse_guard("((L['tensors'][1].size()[1]*L['tensors'][1].size()[0]) % "
                       "L['tensors'][0].size()[0]) == 0")
    assert expr == ("==", ("%", ("*", ("size", 1, 1), ("size", 1, 0)), ("size", 0, 0)), 0)
    tensors = {0: torch.zeros(3, 5), 1: torch.zeros(6, 5)}
    assert evaluate(expr, tensors) is True
    assert render(expr, {0: "input_ids", 1: "mask"}) == \
        "mask.shape[1] * mask.shape[0] % input_ids.shape[0] == 0"
    bounded = parse_guard("torch.sym_min(512, L['tensors'][0].size()[1]) == "
                          "L['tensors'][0].size()[1] and 1 < L['tensors'][0].size()[1] <= 9")
    assert evaluate(bounded, tensors) is True
    assert evaluate(bounded, {0: torch.zeros(1, 10)}) is False
    with pytest.raises(_Unsupported):  # the capture then fixes the dimension it reads
        parse_guard("math.sqrt(L['tensors'][0].size()[0]) == 2")


# -- item 2: dtype changes


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def optimized_llama(captured_llama):
    """The tiny Llama optimized (default budget) from the file's capture at (4, 64); the
    model's untrained twin and the example batch."""
    model, reference, batch, captured = captured_llama
    slim = fxopt.optimize(model, (), example_kwargs=batch, captured=captured)
    return slim, reference, batch


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float64), lambda m: m.to(torch.bfloat16),
                                     lambda m: m.half()], ids=["float64", "bfloat16", "half"])
def test_a_converted_export_captured_module_is_refused_before_any_compute(optimized_llama,
                                                                          convert):
    slim, _, batch = optimized_llama
    converted = convert(copy.deepcopy(slim))
    for mode in ("train", "eval"):
        getattr(converted, mode)()
        with pytest.raises(fxopt.InputError) as error, CountOps() as ops:
            converted(**batch)
        assert ops.ops == [], ops.ops[:5]  # refused before the graph computed anything
        assert "captured by torch.export with model.embed_tokens.weight of dtype torch.float32 " \
               "on cpu" in error.value.what
        assert "parameter or buffer model.embed_tokens.weight" in error.value.where
        assert "call fxopt.optimize on the model after .to(" in error.value.hint


def test_a_module_moved_to_another_device_type_refuses_inputs_left_behind(optimized_llama):
    """Its graphs name no device type, so the whole module may move (``tests/test_device_safety``
    runs it there); inputs left on the CPU are refused before any compute."""
    slim, _, batch = optimized_llama
    moved = copy.deepcopy(slim).to("meta")
    with pytest.raises(fxopt.InputError, match=r"on meta \(where the module is\)"), \
            CountOps() as ops:
        moved(**batch)
    assert ops.ops == []


def test_following_the_hint_optimizes_and_trains_in_the_new_dtype(captured_llama):
    _, reference, _, _ = captured_llama  # the untrained twin
    batch = padded_batch(2, 16, torch.Generator().manual_seed(3))
    model = copy.deepcopy(reference).double()
    reference = copy.deepcopy(reference).double()
    slim = fxopt.optimize(model, (), example_kwargs=batch, predict_memory=False)
    assert next(slim.parameters()).dtype == torch.float64
    assert_same_step(step(slim, batch, seed=0), step(reference, batch, seed=0), "float64")


def test_the_exported_folder_refuses_a_converted_module_too(optimized_llama, tmp_path):
    from fxopt.export.writer import export, load_exported

    slim, _, batch = optimized_llama
    export(slim, tmp_path / "llama")  # the guard is written as code, its checks as literals
    loaded = load_exported(tmp_path / "llama").load()
    torch.manual_seed(0)
    expected = slim(**batch).loss
    torch.manual_seed(0)
    assert torch.equal(loaded(**batch).loss, expected)
    shorter = padded_batch(1, 9, torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    expected = slim(**shorter).loss
    torch.manual_seed(0)
    assert torch.equal(loaded(**shorter).loss, expected)
    loaded.half()
    with pytest.raises(Exception, match="captured by torch.export with model.embed_tokens.weight "
                                        "of dtype torch.float32") as error:
        loaded(**batch)
    assert type(error.value).__name__ == "InputError"


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                  nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("budget", [None, "min"], ids=["default", "min"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16],
                         ids=["float64", "bfloat16", "half"])
def test_an_fx_captured_cnn_computes_in_the_dtype_it_is_converted_to(dtype, budget):
    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 16, 16)
    slim = fxopt.optimize(model, (x,), memory_budget=budget, predict_memory=False)
    assert slim.fxopt_report.trace.frontend == "fx"
    if dtype is torch.float16:
        slim.half()
        reference.half()
    else:
        slim.to(dtype)
        reference.to(dtype)
    assert all(p.dtype == dtype for p in model.parameters())  # the user's own Parameters
    x = x.to(dtype)
    for seed in range(2):
        outputs = []
        for module in (slim, reference):
            module.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            out = module(x)
            out.float().square().sum().backward()
            outputs.append((out, [p.grad for p in module.parameters()]))
        (got, got_grads), (expected, expected_grads) = outputs
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected)
        for a, b in zip(got_grads, expected_grads):
            torch.testing.assert_close(a, b)
