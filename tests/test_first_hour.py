"""What a new user met in the first hour (the issue's items 4 and 7), each fixed and tested.

- ``fxopt bench``: a peer that fails is a row with its reason, and the other rows are measured;
  bench's peak is ``fxopt.measure_train_step``'s, the figure ``optimize`` reports.
- The CLI on a model on the meta device: a usage error (exit 2), as the Python API gives, not an
  internal error.
- An int64 input into a ``Linear`` with a budget: an ``InputError`` (the model does not run),
  not a ``BudgetError``.
- ``fxopt report`` on a CNN with many small-batch BatchNorms: one lint naming them all.
- The exported Hugging Face class is named after the model, not ``GraphModuleImpl``.
- ``fxopt.__version__``.
- An unwritable ``--out``: refused before any work.
- torch internals (``co_varnames is too small``, ``Eq(u0, 1)``, ``u0 (unhinted: u0)``) said in
  words inside fxopt's messages.
"""

import re

import pytest
import torch
from torch import nn

import fxopt
from fxopt.bench.peers import PEERS, Peer
from fxopt.bench.runs import bench, format_table
from fxopt.cli import commands as cli
from fxopt.cli import main


def test_a_failing_peer_is_a_row_and_the_others_are_measured(monkeypatch):
    class Breaks(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            y = torch.sigmoid(self.model(x))
            y.mul_(2)  # an output autograd saved, modified in place: backward refuses, as it
            return y   # did for checkpoint_sequential on mobilenet_v2 (a ReLU6's output)

    def build(model, inputs, fraction):
        return Breaks(model), "a peer that fails"

    monkeypatch.setitem(PEERS, "breaks", Peer("breaks", "fails in backward", build))
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), torch.randn(4, 8)
    rows = bench(model, (x,), memory_budget="min", peers=("breaks", "checkpoint_sequential"),
                 repeats=1)
    by_name = {row.name: row for row in rows}
    assert list(by_name) == ["original", "fxopt", "breaks", "checkpoint_sequential"]
    broken = by_name["breaks"]
    assert broken.train_peak_bytes is None and broken.equivalent is None
    assert "failed" in broken.note and "RuntimeError" in broken.note and "inplace" in broken.note
    assert by_name["checkpoint_sequential"].train_peak_bytes > 0  # measured all the same
    assert by_name["fxopt"].step_seconds is not None
    table = format_table(rows)
    assert re.search(r"^breaks\s+n/a", table, re.M)
    # one definition of the peak: what fxopt.measure and optimize's report say
    assert by_name["original"].train_peak_bytes == fxopt.measure_train_step(model, x).peak_bytes


META = """
import torch
from torch import nn


def on_meta():
    return nn.Sequential(nn.Linear(4, 4, device="meta"), nn.ReLU()), (torch.randn(2, 4),)
"""


def test_the_cli_refuses_a_model_on_the_meta_device_as_a_usage_error(tmp_path, capsys):
    (tmp_path / "meta_model.py").write_text(META)
    code = main(["optimize", f"{tmp_path / 'meta_model.py'}:on_meta", "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "meta device" in err and "internal error" not in err and "to_empty" in err


def test_an_int64_input_into_a_linear_is_an_input_error_with_a_budget_too():
    for budget in (None, 0.5):
        with pytest.raises(fxopt.InputError, match="does not run on the example inputs|reference"):
            fxopt.optimize(nn.Linear(4, 4), torch.ones(2, 4, dtype=torch.long),
                           memory_budget=budget)


def test_report_groups_the_same_lint_on_many_layers(capsys):
    code = main(["report", "zoo:odd_channel_cnn", "--input-shape", "4,3,32,32", "--no-plot"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("normalizes over a batch of 4") == 1
    assert "3 places: 1, 4, 7" in out


def test_the_exported_hugging_face_class_is_named_after_the_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fxopt.export.writer import export

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, use_cache=False))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.warns(UserWarning):
        gm = fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                            verify=False, predict_memory=False)
    assert type(gm).__name__ == "LlamaForCausalLM"
    assert export(gm, tmp_path / "out").class_name == "LlamaForCausalLM"


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", fxopt.__version__)


def test_an_unwritable_out_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(cli, "_load", no_work)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub", "/proc/fxopt-cannot-write-here"):
        assert main(["optimize", "zoo:mlp", "--out", str(out)]) == 2, out
        err = capsys.readouterr().err
        assert "--out" in err and "internal error" not in err, err


class ReadsData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if int((x > 0).sum()) == 1:
            return self.lin(x)
        return x


def test_torch_internals_are_said_in_words():
    from fxopt.capture.export_frontend import capture_with_export
    from fxopt.capture.trace_checks import in_words

    with pytest.raises(fxopt.TraceError) as caught:
        capture_with_export(ReadsData(), (torch.randn(2, 4),))
    what = caught.value.what
    assert "tensor's data" in what and "u0" not in what and "unhinted" not in what
    # symbolic tracing's error on a forward under Hugging Face's (*args, **kwargs) decorators
    said = in_words(ValueError("co_varnames is too small"))
    assert "co_varnames" not in said and "decorator" in said

    class GuardOnDataDependentSymNode(RuntimeError):
        pass

    said = in_words(GuardOnDataDependentSymNode(
        "Could not guard on data-dependent expression Eq(u0, 1) (unhinted: Eq(u0, 1)).  "
        "(Size-like symbols: none)"))
    assert "Eq(" not in said and "== 1" in said
