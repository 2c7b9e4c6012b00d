"""``fxopt.optimize(..., dynamic=False)`` (CLI ``--static-shapes``): torch.export captures the
example's sizes only.

By default an export-captured module serves every batch and sequence size the model's code leaves
free, which costs a third torch.export trace (a batch of 1) and symbolic size arithmetic in all
of them. A training loop at one fixed shape does not need that: with ``dynamic=False`` capture is
two static traces, the optimized module is verified as ever, and a call at any other size is an
``InputError`` that names ``dynamic=False`` before anything is computed, in the optimized module
and in the folder it exports to. Symbolic tracing records no sizes, so the option leaves an
fx-captured module serving any batch size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxopt
from fxopt.capture.export_frontend import STATIC_BY_REQUEST
from fxopt.cli import commands as cli
from fxopt.core.inputs import check_inputs
from fxopt.export.writer import export, load_exported
from helpers import TINY_LLAMA_SOURCE, TINY_LLAMA_VOCAB, tiny_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:fxopt optimized a LlamaForCausalLM")

VOCAB, SEQ = TINY_LLAMA_VOCAB, 16


def batch(rows: int = 2, length: int = SEQ) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(rows))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def static_llama():
    """The tiny Llama optimized at "min" with ``dynamic=False``, with the default device
    elsewhere (``tests/device_mode.py``, the GPU stand-in of tests/test_device_safety.py): no
    tensor fxopt makes may fall on it. The model and its inputs are built before entering, as a
    user's are; every test below then runs the module on the CPU."""
    from device_mode import default_device_elsewhere

    model, inputs = tiny_llama(), batch()
    with default_device_elsewhere():
        gm = fxopt.optimize(model, (), example_kwargs=inputs, memory_budget="min",
                            dynamic=False)
    return model, gm


def test_two_static_traces_verified_and_said_in_the_report(static_llama):
    model, gm = static_llama
    report = gm.fxopt_report
    assert report.trace.frontend == "export"
    assert report.trace.traces == 2  # train and eval mode; no trace at a batch of 1
    assert report.verification.ok and report.verification.checked["param_grad"] > 0
    assert f"sizes: the example's only ({STATIC_BY_REQUEST})" in str(report)
    assert any(p.name == "checkpoint" and p.modified for p in report.passes)
    model.eval()
    gm.eval()
    try:
        with torch.no_grad():
            torch.testing.assert_close(gm(**batch()).logits, model(**batch()).logits)
    finally:  # the module fixture's pair, as the other tests expect it
        model.train()
        gm.train()


@pytest.mark.parametrize("rows, length", [(2, SEQ // 2), (1, SEQ), (4, SEQ)])
def test_any_other_size_is_refused_naming_the_option(static_llama, rows, length):
    _, gm = static_llama
    with pytest.raises(fxopt.InputError) as caught:
        gm(**batch(rows, length))
    assert "captured with dynamic=False" in caught.value.what
    assert "without dynamic=False" in caught.value.hint


def test_the_exported_folder_refuses_other_sizes_the_same_way(static_llama, tmp_path):
    model, gm = static_llama
    result = export(gm, tmp_path / "out", example_inputs=check_inputs(model, (), batch()))
    assert result.verification.ok
    loaded = load_exported(tmp_path / "out").load()
    torch.testing.assert_close(loaded(**batch()).loss, gm(**batch()).loss)
    with pytest.raises(Exception, match="captured with dynamic=False"):
        loaded(**batch(2, SEQ // 2))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_a_dynamic_capture_serves_the_sizes_a_static_one_refuses():
    """The control, on a small model torch.export captures in a fraction of a second: without
    ``dynamic=False`` the batch sizes a static capture refuses are served."""
    model, x = mlp(), torch.randn(4, 6)
    free = fxopt.optimize(model, x, capture="export")
    static = fxopt.optimize(model, x, capture="export", dynamic=False)
    assert free.fxopt_report.trace.traces == 3 and static.fxopt_report.trace.traces == 2
    assert "sizes: input.shape[0] free; a batch of 1 served too" in str(free.fxopt_report)
    for rows in (1, 2, 7):
        other = torch.randn(rows, 6)
        torch.testing.assert_close(free(other), model(other))
        with pytest.raises(fxopt.InputError, match="captured with dynamic=False"):
            static(other)


def test_a_static_capture_is_reused_and_a_dynamic_one_is_not_made_static():
    model, x = mlp(), torch.randn(4, 6)
    static = fxopt.capture_model(model, x, capture="export", dynamic=False)
    gm = fxopt.optimize(model, x, captured=static)
    torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(fxopt.InputError, match="dynamic=False"):
        gm(torch.randn(2, 6))
    free = fxopt.capture_model(model, x, capture="export")
    with pytest.raises(fxopt.ConfigError, match="dynamic=False differ"):
        fxopt.optimize(model, x, captured=free, dynamic=False)


def test_symbolic_tracing_records_no_sizes_either_way():
    model = mlp()
    gm = fxopt.optimize(model, torch.randn(4, 6), dynamic=False)
    assert gm.fxopt_report.trace.frontend == "fx" and not gm.fxopt_report.trace.sizes
    x = torch.randn(7, 6)
    torch.testing.assert_close(gm(x), model(x))
    traced = fxopt.capture_model(model, torch.randn(4, 6))  # a capture serves it too
    reused = fxopt.optimize(model, torch.randn(4, 6), captured=traced, dynamic=False)
    torch.testing.assert_close(reused(x), model(x))


def test_dynamic_must_be_a_bool():
    with pytest.raises(fxopt.ConfigError, match="dynamic='no' is not a bool"):
        fxopt.optimize(nn.Linear(2, 2), torch.randn(1, 2), dynamic="no")


def test_the_cli_option(tmp_path, capsys):
    (tmp_path / "lm.py").write_text(TINY_LLAMA_SOURCE)
    target = f"{tmp_path / 'lm.py'}:llama"
    inputs = ["--input", f"input_ids=2,{SEQ}:int64:0-{VOCAB}", "--input", "labels=@input_ids"]
    assert cli.main(["optimize", target, *inputs, "--static-shapes", "--repeats", "1",
                     "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "in 2 traces" in out and f"sizes: the example's only ({STATIC_BY_REQUEST})" in out
    assert cli.main(["check", target, *inputs, "--static-shapes", "--batch-sizes", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "with dynamic=False" in err and "--static-shapes" in err


def test_verification_that_must_leave_the_example_size_goes_to_full_size_at_once():
    """Where the original's step does not fit, the proof runs at a smaller batch, which a static
    module refuses: it goes to full size (on the CPU copies, here the CPU itself) without
    spending a step of the original on the smaller batch."""
    from fxopt.verify.fitting import verify_where_it_fits

    model, x = mlp(), torch.randn(8, 6)
    static = fxopt.optimize(model, x, capture="export", dynamic=False, verify=False)
    batches = []
    model.register_forward_pre_hook(lambda module, args: batches.append(args[0].shape[0]))
    verified = verify_where_it_fits(model, static, (x,), mode="reduced")
    assert verified.report.ok
    assert verified.where.startswith("full size on cpu")
    assert set(batches) == {8}  # the original never ran at the smaller batch


def test_the_static_module_under_what_training_scripts_do_to_it(static_llama):
    """The new state is the input guard's ``static`` flag: it survives a deep copy, a state dict
    loaded with ``assign=True`` and an error mid-call, and a dtype conversion is refused as for
    any export-captured module."""
    import copy

    model, gm = static_llama
    expected = gm(**batch()).loss
    twin = copy.deepcopy(gm)
    torch.testing.assert_close(twin(**batch()).loss, expected)
    with pytest.raises(fxopt.InputError, match="captured with dynamic=False"):
        twin(**batch(2, SEQ // 2))
    twin.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    torch.testing.assert_close(twin(**batch()).loss, expected)
    grad_mode = torch.is_grad_enabled()
    with pytest.raises(fxopt.InputError):  # refused mid-call, before any compute
        twin(**batch(4, SEQ))
    assert torch.is_grad_enabled() == grad_mode
    torch.testing.assert_close(twin(**batch()).loss, expected)
    with pytest.raises(fxopt.InputError, match="converted after capture"):
        copy.deepcopy(gm).to(torch.float64)(**batch())


def test_a_static_capture_with_the_default_device_elsewhere_names_no_device(static_llama):
    """The GPU stand-in of tests/test_device_safety.py: the module fixture optimized with a
    default device no tensor fxopt makes may fall on; it trains on the CPU."""
    model, gm = static_llama
    try:
        gm(**batch()).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        model.zero_grad(set_to_none=True)
    assert gm.fxopt_report.trace.traces == 2
