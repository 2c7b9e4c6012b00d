"""Errors that lead somewhere (issue 25, item 4): the worst relative change is reported as such,
a verification failure that capture itself causes says so and names the frontend, and torch's
own capture logging stays out of the way unless FXOPT_VERBOSE=1 asks for it."""

import math
import warnings

import pytest
import torch
from torch import nn

import fxopt
from fxopt.core.errors import EquivalenceError, TraceError
from fxopt.verify import verify


class Const(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.value * self.scale + 0 * x.sum()


def test_max_rel_diff_is_the_worst_relative_change_a_zero_that_moved_included():
    ref = torch.tensor([1000.0, 0.0, 1.0])
    cand = torch.tensor([1000.1, 3.57, 1.0])  # 1e-4 relative, and a 0 that became 3.57
    report = verify(Const(ref), Const(cand), torch.zeros(1), check_eval=False)
    (mismatch,) = [m for m in report.mismatches if m.kind == "output"]
    assert math.isinf(mismatch.max_rel_diff)  # was 0.0001: the 0 did not count
    assert "reference 0 vs candidate 3.57" in mismatch.detail
    moved = torch.tensor([1000.0, 2.0, 1.0]), torch.tensor([1000.1, 3.0, 1.0])
    report = verify(Const(moved[0]), Const(moved[1]), torch.zeros(1), check_eval=False)
    (mismatch,) = [m for m in report.mismatches if m.kind == "output"]
    assert mismatch.max_rel_diff == pytest.approx(0.5)  # the worst element, not the average
    with pytest.raises(EquivalenceError, match="max rel diff inf"):
        verify(Const(ref), Const(cand), torch.zeros(1), check_eval=False, strict=True)


class PostNormEncoder(nn.Module):
    """nn.TransformerEncoder, post-norm, with a padding mask: in eval mode it takes the
    nested-tensor fast path, which torch.export does not follow."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)

    def forward(self, x, mask):
        return self.encoder(x, src_key_padding_mask=mask)


def _encoder_and_inputs():
    torch.manual_seed(0)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 5:] = True
    return PostNormEncoder(), (torch.randn(2, 8, 32), mask)


@pytest.mark.parametrize("passes", [None, []])
def test_a_failure_capture_causes_says_so_and_names_the_frontend(passes):
    model, inputs = _encoder_and_inputs()
    with warnings.catch_warnings(), pytest.raises(EquivalenceError) as caught:
        warnings.simplefilter("ignore")  # torch's nested-tensor prototype warning
        fxopt.optimize(model, inputs, passes=passes, capture="export")
    error = caught.value
    assert error.what.startswith("capture changed the function")
    assert "torch.export (capture='export')" in error.what and "passes=[]" in error.what
    assert "bisect" not in error.hint and "capture='fx'" in error.hint
    assert "eval_output" in error.where  # the nested-tensor path runs in eval mode only
    assert error.report is not None and not error.report.ok


def test_a_failure_the_passes_cause_still_says_to_bisect_them(monkeypatch):
    from fxopt.verify import blame

    model, inputs = _encoder_and_inputs()
    error = EquivalenceError("the optimized model differs", where="output", hint="bisect")
    same = blame.capture_blamed(error, frontend="fx", not_used=(), passes_changed=["reorder"],
                                model=model, args=inputs,
                                unoptimized=fxopt.trace(model, inputs))
    assert same is error  # the unoptimized capture verifies: a pass is to blame


ROOT_BRANCHES = """
import torch
from torch import nn


class RootBranches(nn.Module):
    \"\"\"Reads a value in its own forward: torch.export stops there, and no submodule can be
    kept opaque around it.\"\"\"

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        if h.mean() > 0:
            h = h * 2
        return self.out(torch.relu(h))
"""


@pytest.fixture
def root_branches(tmp_path):
    path = tmp_path / "root_branches.py"
    path.write_text(ROOT_BRANCHES)
    namespace = {}
    exec(compile(ROOT_BRANCHES, str(path), "exec"), namespace)
    return path, namespace["RootBranches"]()


def test_torch_capture_logging_is_held_back_and_fxopt_s_error_comes_alone(capfd, monkeypatch,
                                                                          root_branches):
    monkeypatch.delenv("FXOPT_VERBOSE", raising=False)
    model, inputs = root_branches[1], (torch.randn(4, 8),)
    with pytest.raises(TraceError) as caught:
        fxopt.optimize(model, inputs, capture="export", verify=False)
    out, err = capfd.readouterr()
    assert "def forward" not in err and "Unable to find user code" not in err, err[:500]
    assert out == ""
    assert not getattr(caught.value, "__notes__", None)


def test_fxopt_verbose_shows_torch_s_log_after_fxopt_s_error(capfd, monkeypatch, root_branches):
    monkeypatch.setenv("FXOPT_VERBOSE", "1")
    model, inputs = root_branches[1], (torch.randn(4, 8),)
    with pytest.raises(TraceError) as caught:
        fxopt.optimize(model, inputs, capture="export", verify=False)
    (note,) = caught.value.__notes__
    assert note.startswith("torch's own log while capturing (FXOPT_VERBOSE=1)")
    assert "Unable to find user code" in note and "def forward" in note
    assert "def forward" not in capfd.readouterr().err  # in the note, not printed before it


def test_the_cli_prints_torch_s_log_after_the_error_with_fxopt_verbose(capsys, monkeypatch,
                                                                        root_branches):
    from fxopt.cli import commands as cli

    monkeypatch.setenv("FXOPT_VERBOSE", "1")
    code = cli.main(["optimize", f"{root_branches[0]}:RootBranches", "--input-shape", "4,8",
                     "--capture", "export", "--no-verify", "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("fxopt: torch.export cannot capture RootBranches")
    assert err.index("torch's own log while capturing") > err.index("what to do:")
