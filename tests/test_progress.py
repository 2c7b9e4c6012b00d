"""Progress as it happens (issue: "Silence while it works, and minutes of it").

``fxopt.optimize`` tells each phase (capture, predict, each pass, verify) through the "fxopt"
logger when it starts and ends, draws a status line on a terminal, and is quiet in a pipe unless
asked (``FXOPT_PROGRESS=1``, the CLI's ``--progress``). ``fxopt --help`` answers without
importing torch.
"""

import io
import logging
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import fxopt
from fxopt.core import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4)), torch.randn(4, 8)


def test_optimize_logs_each_phase_with_its_time(caplog, monkeypatch):
    monkeypatch.delenv(progress.ENVIRONMENT, raising=False)
    model, x = small_model()
    with caplog.at_level(logging.INFO, logger="fxopt"):
        fxopt.optimize(model, x, memory_budget="min")
    messages = [r.getMessage() for r in caplog.records if r.name == "fxopt"]
    assert messages[0] == "optimize Sequential ..."  # before any work
    started = [m.removesuffix(" ...") for m in messages if m.endswith(" ...")]
    for phase in ("capture", "predict", "passes", "inplace_activations", "checkpoint",
                  "reorder", "verify"):
        assert phase in started, (phase, messages)
        assert any(m.startswith(f"{phase}: ") and m.endswith(" s") for m in messages), phase
    assert started.index("capture") < started.index("checkpoint") < started.index("verify")
    assert messages[-1].startswith("optimize Sequential: ")


def test_quiet_in_a_pipe_unless_asked(capsys, monkeypatch):
    monkeypatch.delenv(progress.ENVIRONMENT, raising=False)
    model, x = small_model()
    fxopt.optimize(model, x)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(progress.ENVIRONMENT, "1")
    fxopt.optimize(model, x)
    err = capsys.readouterr().err
    assert "fxopt: optimize Sequential › capture ...\n" in err
    assert "fxopt: optimize Sequential › passes › reorder: " in err
    assert "\r" not in err  # plain lines in a pipe


def test_a_terminal_gets_a_status_line_that_is_erased_at_the_end(monkeypatch):
    monkeypatch.delenv(progress.ENVIRONMENT, raising=False)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    model, x = small_model()
    fxopt.optimize(model, x)
    drawn = terminal.getvalue()
    assert "\rfxopt optimize Sequential › capture" in drawn
    assert "optimize Sequential › passes › reorder" in drawn
    assert drawn.endswith("\r\x1b[K")  # nothing left on the line
    monkeypatch.setenv(progress.ENVIRONMENT, "0")
    terminal.seek(0), terminal.truncate()
    fxopt.optimize(model, x)
    assert terminal.getvalue() == ""


class _Seen(Exception):
    pass


def test_a_56m_parameter_llama_shows_progress_within_2_seconds(monkeypatch):
    """The issue's model printed nothing for 166 s. The first line is drawn before any work, so
    the test stops optimize there (a handler that raises) instead of spending minutes."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.delenv(progress.ENVIRONMENT, raising=False)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
        num_attention_heads=8, use_cache=False))
    assert 50e6 < sum(p.numel() for p in model.parameters()) < 60e6
    ids = torch.randint(0, 32000, (2, 256))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    seen = []

    class Stop(logging.Handler):
        def emit(self, record):
            seen.append((time.perf_counter(), record.getMessage(), terminal.getvalue()))
            if record.getMessage().startswith("capture"):
                raise _Seen

    handler = Stop(level=logging.INFO)
    logger = logging.getLogger("fxopt")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears isEnabledFor's cache
    start = time.perf_counter()
    try:
        with pytest.raises(_Seen):
            fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                           memory_budget="min")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    first_time, first, drawn = seen[0]
    assert first == "optimize LlamaForCausalLM ..." and first_time - start < 2.0
    assert "fxopt optimize LlamaForCausalLM" in seen[1][2]  # on the terminal by capture's start


def test_cli_progress_flag_tells_phases_in_a_pipe(capsys, monkeypatch):
    from fxopt.cli.commands import main

    monkeypatch.delenv(progress.ENVIRONMENT, raising=False)
    assert main(["optimize", "zoo:mlp", "--repeats", "1", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "fxopt: optimize zoo:mlp › optimize " in err and "› verify: " in err
    assert main(["optimize", "zoo:mlp", "--repeats", "1"]) == 0
    assert capsys.readouterr().err == ""


def test_help_does_not_import_torch():
    """``fxopt --help`` took 4.3 s, most of it importing torch and every layer."""
    code = ("import sys\nfrom fxopt.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in ('torch', 'fxopt.api') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().endswith("[]"), out[-500:]
    assert "usage: fxopt" in out
