"""The fxopt CLI: every subcommand in-process (main(argv) -> exit code), each entry point as a
subprocess, exit codes 0/1/2/3, one-block errors without tracebacks, quiet progress when piped."""

import importlib.util
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fxopt.passes as registry
from fxopt.check import SCHEMA
from fxopt.cli import commands as cli
from fxopt.cli.progress import Progress
from fxopt.cli.targets import DTYPES
from fxopt.core.errors import ConfigError
from fxopt.rewrite.pass_base import PassResult, mark_new

VENV_BIN = Path(sys.executable).parent
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(
    not HAS_MATPLOTLIB, reason="plots need the plot extra: pip install -e '.[plot]'")
TINY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return torch.relu(self.fc(x))
"""


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_optimize_prints_the_table_and_exports(tmp_path, capsys):
    code, out, _ = run(["optimize", "zoo:mlp", "--out", str(tmp_path / "out"), "--repeats", "1",
                        "--threads", "1"], capsys)
    assert code == 0
    for row in ("inplace_activations", "train peak, measured", "train peak, predicted",
                "inference peak, measured", "train step, fastest of", "train step, median of",
                "train step, slowest of", "verification: equivalent",
                "device: cpu, 1 torch thread;", "parameters, buffers and inputs included",
                "loads with torch only"):
        assert row in out, row
    document = json.loads((tmp_path / "out" / "report.json").read_text())
    assert document["schema"] == "fxopt.optimize/1"
    assert document["target"] == "zoo:mlp" and document["input_shapes"] == [[8, 784]]
    assert document["comparison"]["before"]["train_measured"] > 0
    times = document["comparison"]["step_times"]
    assert times["before"]["fastest_seconds"] <= times["before"]["median_seconds"] \
        <= times["before"]["slowest_seconds"]
    assert isinstance(times["within_noise"], bool) and document["comparison"]["torch_threads"] == 1
    assert document["export"]["verification"]["ok"] is True
    assert (tmp_path / "out" / "model.py").is_file()


@needs_matplotlib
def test_report_prints_breakdown_and_lints_and_draws_the_plot(tmp_path, capsys):
    plot = tmp_path / "memory.png"
    code, out, _ = run(["report", "zoo:odd_channel_cnn", "--plot", str(plot)], capsys)
    assert code == 0
    assert "saved for backward" in out and "activations at the peak" in out
    # one lint for the three small-batch BatchNorms (it was one per layer, each naming its
    # channel count: mobilenet_v2 printed 52)
    assert out.count("BatchNorm2d normalizes over a batch of 4") == 1 and "sync_bn" in out
    assert "3 places: 1, 4, 7" in out
    assert "seed 0" not in out  # internal labels of the tip documents stay out of user output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {plot} (before peak" in out


@needs_matplotlib
def test_report_captures_the_model_once_and_plots_what_optimize_makes(tmp_path, capsys,
                                                                        monkeypatch):
    """The breakdown, the lints and the optimized module of the plot share one capture (on a
    Hugging Face model a capture is three torch.export traces), and the plot's "after" peak is
    that of the module a fresh ``fxopt.optimize`` builds. The command's work runs with the
    default device elsewhere (``meta``), the model and inputs on the CPU: a tensor made without
    a device on the way (a CPU tensor beside CUDA ones, on a GPU) fails it."""
    import fxopt
    import fxopt.api
    import fxopt.capture.reuse
    import fxopt.cli.targets
    from device_mode import default_device_elsewhere
    from fxopt.cli.targets import load_target
    from fxopt.measure.timeline import training_timeline

    captures, real = [], fxopt.capture.reuse.capture_chain

    def counted(*args, **kwargs):
        captures.append(kwargs.get("capture"))
        return real(*args, **kwargs)

    loaded = load_target("zoo:transformer_block")
    monkeypatch.setattr(fxopt.capture.reuse, "capture_chain", counted)
    monkeypatch.setattr(fxopt.api, "capture_chain", counted)
    monkeypatch.setattr(fxopt.cli.targets, "load_target", lambda *args, **kwargs: loaded)
    with default_device_elsewhere():
        code, out, err = run(["report", "zoo:transformer_block", "--memory-budget", "min",
                              "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 0, err
    assert captures == ["auto"], captures
    monkeypatch.undo()
    model, inputs = load_target("zoo:transformer_block")
    fresh = fxopt.optimize(model, inputs, memory_budget="min")
    after = training_timeline(fresh, inputs).peak_bytes / 2**20
    assert f"after fxopt peak {after:.1f} MiB" in out, out


def test_report_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now fails
    code, out, _ = run(["report", "zoo:mlp", "--no-plot", "--json"], capsys)
    assert code == 0
    document = json.loads(out)
    assert document["schema"] == "fxopt.report/1" and document["target"] == "zoo:mlp"
    assert document["breakdown"]["train"]["peak_bytes"] > 0 and document["timelines"] == []
    assert {lint["code"] for lint in document["lints"]} == {"not-multiple-of-8"}
    # only the plot needs matplotlib: the report is printed, then one line saying how to get it
    code, out, err = run(["report", "zoo:mlp", "--plot", str(tmp_path / "m.png")], capsys)
    assert code == 0 and "saved for backward" in out and "Traceback" not in err
    (line,) = [line for line in out.splitlines() if "matplotlib" in line]
    assert line.startswith("no plot: matplotlib is not installed")
    assert "pip install 'fxopt[plot]'" in line
    assert out.index("saved for backward") < out.index(line) and not (tmp_path / "m.png").exists()
    code, out, err = run(["report", "zoo:mlp", "--json"], capsys)
    assert code == 0 and json.loads(out)["timelines"] == [] and "pip install 'fxopt[plot]'" in err


def _off_by_a_bit(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    with gm.graph.inserting_before(out):
        shifted = mark_new(gm.graph.call_function(_shift, (value,)), "off_by_a_bit")
    shifted.meta["val"] = value.meta["val"]
    out.args = (shifted,)
    return PassResult(gm, True, {})


def _shift(x):
    return x + 1e-2


def test_check_exit_codes_and_json(capsys, monkeypatch):
    code, out, err = run(["check", "zoo:mlp", "--batch-sizes", "1,8", "--seeds", "3"], capsys)
    assert code == 0, err
    assert "batch 8, seed 3 (example inputs)" in out and "batch 1, seed 3 (random inputs)" in out
    assert "equivalent: 3 of 3 runs match" in out
    monkeypatch.setattr(registry, "REGISTRY", registry.REGISTRY.with_pass(
        registry.PassSpec("off_by_a_bit", _off_by_a_bit, "planted", default=False)))
    code, out, _ = run(["check", "zoo:mlp", "--passes", "off_by_a_bit", "--seeds", "0",
                        "--json"], capsys)
    document = json.loads(out)
    assert code == 1 and document["schema"] == SCHEMA and not document["ok"]
    assert document["passes"] == [{"name": "off_by_a_bit", "modified": True},
                                   {"name": "keep_blocks", "modified": False}]
    assert [(r["batch_size"], r["seed"], r["inputs"], r["ok"]) for r in document["runs"]] == [
        (8, 0, "example", False), (8, 0, "random", False)]
    assert document["summary"] == {"runs": 2, "failed_runs": 2, "mismatches": 4}
    mismatch = document["runs"][0]["mismatches"][0]
    assert mismatch["kind"] in ("output", "eval_output") and mismatch["name"] == "output"
    assert mismatch["max_abs"] == pytest.approx(1e-2, rel=1e-3)
    assert set(mismatch) == {"kind", "name", "max_abs", "max_rel", "rtol", "atol", "detail"}


def test_bench_table_and_json(capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1: --threads 1 must change it, then restore it
    try:
        _bench_table_and_json(capsys)
    finally:
        torch.set_num_threads(before)


def _bench_table_and_json(capsys):
    threads = torch.get_num_threads()
    code, out, _ = run(["bench", "zoo:mlp", "--peers", "checkpoint_sequential", "--repeats", "1",
                        "--threads", "1", "--json"], capsys)
    assert code == 0
    document = json.loads(out)
    assert document["schema"] == "fxopt.bench/1" and document["device"].endswith("1 thread")
    assert document["train_peak"] == "the whole step, parameters, buffers and inputs included"
    rows = document["results"][0]["rows"]
    assert [r["name"] for r in rows] == ["original", "fxopt", "checkpoint_sequential"]
    assert rows[0]["memory_ratio"] == 1.0 and rows[1]["train_peak_bytes"] > 0
    assert rows[0]["train_peak_bytes"] > rows[0]["baseline_bytes"] > 0  # parameters included
    assert all(r["step_fastest_seconds"] <= r["step_seconds"] <= r["step_slowest_seconds"]
               for r in rows)
    assert torch.get_num_threads() == threads  # --threads is restored after


def test_bench_reads_every_budget_before_any_work(capsys, monkeypatch):
    import fxopt.bench.runs as runs

    def never(*args, **kwargs):
        raise AssertionError("bench started before every budget was read")

    monkeypatch.setattr(runs, "bench", never)
    code, _, err = run(["bench", "zoo:mlp", "--budgets", "1.0,0.5,lots"], capsys)
    assert code == 2 and "cannot read memory budget 'lots'" in err


def test_capture_option_picks_the_frontend(capsys):
    code, out, err = run(["optimize", "zoo:transformer_block", "--capture", "export",
                          "--repeats", "1"], capsys)
    assert code == 0, err
    assert "captured by export (torch.export)" in out
    assert "fx not used: capture='export' was asked for" in out
    assert "verification: equivalent" in out
    code, out, err = run(["check", "zoo:mlp", "--capture", "fx", "--seeds", "0"], capsys)
    assert code == 0 and "equivalent: 2 of 2 runs match" in out, err
    code, out, err = run(["report", "zoo:mlp", "--capture", "export", "--no-plot", "--json"],
                         capsys)
    assert code == 0 and json.loads(out)["breakdown"]["train"]["peak_bytes"] > 0, err
    code, out, err = run(["bench", "zoo:mlp", "--capture", "export", "--peers", "none",
                          "--repeats", "1", "--json"], capsys)
    assert code == 0, err
    fxopt_row = json.loads(out)["results"][0]["rows"][1]
    assert fxopt_row["name"] == "fxopt" and fxopt_row["train_peak_bytes"] > 0
    assert "capture=export" in fxopt_row["note"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["optimize", "zoo:mlp", "--capture", "bogus"])
    assert exit_info.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_errors_are_one_block_with_a_hint(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny.py").write_text(TINY)
    code, _, err = run(["check", f"{tmp_path / 'tiny.py'}:Nett", "--input-shape", "2,6"], capsys)
    assert code == 2 and "has no attribute 'Nett'; did you mean 'Net'?" in err
    assert "Traceback" not in err and err.startswith("fxopt: TARGET not found")
    code, _, err = run(["optimize", "zoo:mlp", "--passes", "reorder,inplace"], capsys)
    assert code == 2 and "out of order" in err and "what to do:" in err
    with pytest.raises(ConfigError):
        cli.main(["optimize", "zoo:mlp", "--passes", "nonsense", "--debug"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", "zoo:mlp", "--input-shape", "8,-1"])
    assert exit_info.value.code == 2 and "positive sizes" in capsys.readouterr().err

    def crash(args):
        raise RuntimeError("boom")

    monkeypatch.setitem(cli.COMMANDS, "check", crash)
    code, _, err = run(["check", "zoo:mlp"], capsys)
    assert code == 3 and "internal error: RuntimeError: boom" in err and "--debug" in err


def test_progress_draws_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        bar = Progress("work", stream=stream, width=4)
        bar(1, 2, "first")
        bar(2, 2, "second")
    assert pipe.getvalue() == ""
    assert "\r" in terminal.getvalue() and "[##..] 1/2 first" in terminal.getvalue()
    assert terminal.getvalue().endswith("2/2 second\x1b[K\n")


def test_report_figures_agree_with_measure():
    from fxopt import models_zoo
    from fxopt.measure.breakdown import memory_breakdown
    from fxopt.measure.peaks import measure_train_step
    from fxopt.measure.timeline import training_timeline

    model, inputs = models_zoo.build("mnist_net", 2)
    timeline = training_timeline(model, inputs)
    measured = measure_train_step(model, inputs)
    assert timeline.peak_bytes == measured.peak_bytes  # the same tracker, the same step
    assert timeline.baseline_bytes == measured.baseline_bytes
    assert 0 < timeline.backward_start < len(timeline.ops)
    assert all(p.grad is None for p in model.parameters())  # left as it was
    breakdown = memory_breakdown(model, inputs)
    largest = breakdown.saved[0]
    assert largest.nbytes == max(s.nbytes for s in breakdown.saved)
    assert largest.value == "relu_1" and largest.shape == (2, 64, 24, 24)
    assert "x = F.relu(self.conv2(x))" in largest.produced_by
    assert set(largest.kept_for) == {"relu_1", "max_pool2d"}


def test_dtype_choices_match_the_loader():
    dtype_action = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices[
        "check"]._actions if a.dest == "dtype")
    assert sorted(dtype_action.choices) == sorted(DTYPES)


def test_the_console_entry_sets_its_process_collector_and_the_command_function_does_not():
    """``fxopt.cli.main`` (the console script, ``python -m fxopt``) owns its process and
    collects garbage less often; ``fxopt.cli.commands.main``, for a caller's own process, leaves
    the collector as the caller set it."""
    import gc

    from fxopt.cli import THRESHOLDS, main as console

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with pytest.raises(SystemExit):
            cli.main(["--help"])
        assert gc.get_threshold() == (700, 10, 10)
        with pytest.raises(SystemExit):
            console(["--help"])
        assert gc.get_threshold() == THRESHOLDS != (700, 10, 10)
    finally:
        gc.set_threshold(*saved)


def test_entry_points_as_subprocesses(tmp_path):
    """The console script and ``python -m fxopt``, one process per subcommand: exit codes, JSON
    on stdout, one-block errors, and no progress bar when piped. (A process costs seconds of
    imports and warm-up: the success paths of optimize and bench are tested in-process.)"""
    fxopt, module = [str(VENV_BIN / "fxopt")], [sys.executable, "-m", "fxopt"]
    commands = {
        "check": fxopt + ["check", "zoo:mlp", "--json", "--seeds", "0"],
        "optimize": module + ["optimize", "zoo:mlpp"],
        "report": module + ["report", "zoo:mlp", "--json"]
        + (["--plot", "m.png"] if HAS_MATPLOTLIB else ["--no-plot"]),
        "bench": fxopt + ["bench", "zoo:mlp", "--peers", "checkpoint_sequentail"],
    }
    # one intra-op thread: this process waits meanwhile, and CI's two cores are shared
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST")},
           "OMP_NUM_THREADS": "1"}
    done = {}
    for name, argv in commands.items():
        process = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=300)
        done[name] = (process.returncode, process.stdout, process.stderr)

    code, out, err = done["check"]
    assert code == 0, err[-2000:]
    assert json.loads(out)["ok"] is True
    assert "[" not in err  # no progress bar in a pipe

    code, out, err = done["optimize"]
    assert code == 2 and err.startswith("fxopt: unknown zoo model 'mlpp'; did you mean 'mlp'?")
    assert "Traceback" not in err

    code, out, err = done["report"]
    assert code == 0, err[-2000:]
    assert json.loads(out)["timelines"][0]["label"] == "before"
    assert (tmp_path / "m.png").is_file() == HAS_MATPLOTLIB

    code, out, err = done["bench"]  # its table is tested in-process; here the exit path
    assert code == 2 and "unknown peer(s) ['checkpoint_sequentail']" in err
    assert "known peers: checkpoint_sequential" in err and "Traceback" not in err


KEYWORDS = """
import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, mask=None, labels=None):
        logits = self.fc(x if mask is None else x * mask)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}
"""


def test_keyword_inputs_from_a_file_and_ecosystem_targets(tmp_path, capsys):
    (tmp_path / "kw.py").write_text(KEYWORDS)
    torch.save({"x": torch.randn(4, 6), "labels": torch.tensor([0, 2, 1, 0])},
               tmp_path / "inputs.pt")
    code, out, _ = run(["optimize", f"{tmp_path / 'kw.py'}:Classifier", "--inputs",
                        str(tmp_path / "inputs.pt"), "--out", str(tmp_path / "out"),
                        "--repeats", "1"], capsys)
    assert code == 0 and "verification: equivalent: 2 output" in out, out
    document = json.loads((tmp_path / "out" / "report.json").read_text())
    assert document["input_shapes"] == [[4, 6], "None", [4]]  # mask skipped: its default
    torch.save([torch.randn(4, 6)], tmp_path / "positional.pt")
    code, out, _ = run(["check", f"{tmp_path / 'kw.py'}:Classifier", "--inputs",
                        str(tmp_path / "positional.pt")], capsys)
    assert code == 0, out
    code, _, err = run(["optimize", f"{tmp_path / 'kw.py'}:Classifier", "--inputs",
                        str(tmp_path / "missing.pt")], capsys)
    assert code == 2 and "cannot read --inputs" in err
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("eco: targets need the test extra")
    from fxopt.integrations.hf_trainer import TrainerCheckpointWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, _ = run(["check", "eco:hf_bert_classifier"], capsys)
    assert code == 0 and "equivalent" in out.lower(), out
    # advice for a module handed to transformers.Trainer in Python: no command hands one over
    assert not [w for w in caught if issubclass(w.category, TrainerCheckpointWarning)]


# --- item 3: --device ---------------------------------------------------------------------------

def test_device_cuda_without_a_gpu_is_a_usage_error_that_says_what_to_do(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine with one
    code, out, err = run(["optimize", "zoo:mlp", "--device", "cuda"], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("fxopt: --device cuda: no CUDA device is available")
    assert "where: --device" in err and "what to do:" in err and "--device cpu" in err
    code, _, err = run(["check", "zoo:mlp", "--device", "tpu"], capsys)
    assert code == 2 and "unknown --device 'tpu'" in err and "cuda:N" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = run(["check", "zoo:mlp", "--device", "cuda:3"], capsys)
    assert code == 2 and "there is no GPU 3; this machine has 1 (cuda:0)" in err


def test_device_cpu_runs_on_the_cpu(capsys):
    code, out, err = run(["check", "zoo:mlp", "--device", "cpu", "--seeds", "0"], capsys)
    assert code == 0 and "equivalent: 2 of 2 runs match" in out, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_device_cuda_moves_model_and_inputs_and_reads_the_allocator(tmp_path, capsys):
    code, out, err = run(["optimize", "zoo:odd_channel_cnn", "--device", "cuda", "--repeats", "1",
                          "--memory-budget", "min", "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert "device: cuda:0" in out and "CUDA caching allocator" in out
    assert "verification: equivalent" in out
    code, out, err = run(["bench", "zoo:odd_channel_cnn", "--device", "cuda:0", "--repeats", "1",
                          "--peers", "checkpoint_sequential", "--json"], capsys)
    assert code == 0, err
    assert "(CUDA)" in json.loads(out)["device"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_python_api_takes_a_model_and_inputs_already_on_cuda():
    import fxopt
    from fxopt import models_zoo

    model, inputs = models_zoo.build("odd_channel_cnn")
    model, inputs = model.cuda(), tuple(t.cuda() for t in inputs)
    slim = fxopt.optimize(model, inputs, memory_budget="min", measure_memory=True)
    assert slim.fxopt_report.verification.ok
    assert all(p.is_cuda for p in slim.parameters())
    assert slim.fxopt_report.memory_after.train.method == "CUDA caching allocator"
    assert slim(*inputs).is_cuda


# --- item 4: inputs from the command line -------------------------------------------------------

LM = """
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(torch.relu(h))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x, ids):
        return torch.relu(self.fc(x + self.embed(ids)))


def with_inputs():
    return TwoInputs(), (torch.randn(2, 6), torch.randint(0, 50, (2,)))


def with_kwargs():
    ids = torch.randint(0, 50, (2, 5))
    return TinyLM(), {"input_ids": ids, "labels": ids}


def with_args_and_kwargs():
    ids = torch.randint(0, 50, (2, 5))
    return TinyLM(), (ids,), {"labels": ids}


def with_one_tensor():
    return TinyLM(), torch.randint(0, 50, (3, 4))


def broken():
    return TinyLM(), 1, 2, 3


def raises():
    raise ValueError("no weights here")
"""


@pytest.fixture
def lm_file(tmp_path):
    path = tmp_path / "lm.py"
    path.write_text(LM)
    return str(path)


def test_input_spec_grammar():
    from fxopt.cli.inputs import parse_input_spec
    from fxopt.core.errors import InputError

    spec = parse_input_spec("input_ids=4,256:int64:0-50257")
    assert (spec.name, spec.shape, spec.dtype, spec.value_range) == (
        "input_ids", (4, 256), "int64", (0, 50257))
    spec = parse_input_spec("8x3x32x32:float16:-1-1")
    assert (spec.name, spec.shape, spec.dtype, spec.value_range) == (
        None, (8, 3, 32, 32), "float16", (-1, 1))
    assert parse_input_spec("labels=@input_ids").same_as == "input_ids"
    for bad, says in (("4,0", "positive sizes"), ("4,4:int8", "unknown dtype 'int8'"),
                      ("4:int64:0.5-3", "integer range"), ("4:int64:9-3", "LOW must be below"),
                      ("4:bool:0-2", "no value range"), ("1x=4", "bad input name"),
                      ("@ids", "NAME=@OTHER"), ("4:int64:0..9", "bad value range")):
        with pytest.raises(InputError) as info:
            parse_input_spec(bad)
        assert says in str(info.value), (bad, str(info.value))


def test_several_positional_and_keyword_inputs_with_integer_ranges(lm_file, capsys):
    from fxopt.cli.inputs import parse_input_spec
    from fxopt.cli.targets import load_target

    specs = [parse_input_spec(text) for text in (
        "input_ids=4,9:int64:0-50", "attention_mask=4,9:int64:1-2", "labels=@input_ids")]
    model, inputs = load_target(f"{lm_file}:TinyLM", input_specs=specs)
    ids, mask, labels = inputs  # bound to forward's parameters by name
    assert ids.shape == (4, 9) and ids.dtype == torch.int64 and ids.max() > 1 and ids.max() < 50
    assert bool((mask == 1).all()) and labels is ids
    specs = [parse_input_spec("2,6"), parse_input_spec("2:int64")]
    _, (x, small) = load_target(f"{lm_file}:TwoInputs", input_specs=specs, int_range=(0, 50))
    assert x.dtype == torch.float32 and small.max() < 50 and small.dtype == torch.int64
    _, (ids,) = load_target("zoo:transformer_lm", input_shape=(2, 16), int_range=(0, 1000))
    assert ids.shape == (2, 16) and 1 < int(ids.max()) < 1000
    _, (ids,) = load_target(f"{lm_file}:TinyLM", input_shape=(3, 7), dtype="int64",
                            int_range=(0, 50))
    assert ids.dtype == torch.int64 and 1 < int(ids.max()) < 50
    code, out, err = run(["check", f"{lm_file}:TinyLM", "--input", "input_ids=2,5:int64:0-50",
                          "--input", "labels=@input_ids", "--seeds", "0"], capsys)
    assert code == 0 and "equivalent: 2 of 2 runs match" in out, err


def test_integer_inputs_without_a_range_say_so(lm_file, capsys):
    code, _, err = run(["check", f"{lm_file}:TinyLM", "--input-shape", "2,5", "--dtype", "int64",
                        "--seeds", "0"], capsys)
    assert code == 0
    assert "note: the int64 input is drawn from 0-1 (zeros and ones)" in err
    assert "--int-range 0,VOCAB" in err
    code, _, err = run(["check", f"{lm_file}:TinyLM", "--input-shape", "2,5", "--int-range",
                        "0,50"], capsys)  # a float input: nothing for the range to apply to
    assert code == 2 and "--int-range has no integer input to apply to" in err
    code, _, err = run(["check", f"{lm_file}:TinyLM", "--input-shape", "2,5", "--input", "2,5"],
                       capsys)
    assert code == 2 and "--input-shape and --input both describe the example inputs" in err
    code, _, err = run(["check", f"{lm_file}:TinyLM", "--input", "labels=@input_ids"], capsys)
    assert code == 2 and "reuses 'input_ids', which no --input before it names" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", f"{lm_file}:TinyLM", "--int-range", "5,1"])
    assert exit_info.value.code == 2 and "LOW must be below HIGH" in capsys.readouterr().err


def test_factory_returning_the_model_and_its_inputs(lm_file, capsys):
    from fxopt.cli.targets import load_target
    from fxopt.core.errors import InputError

    model, (x, ids) = load_target(f"{lm_file}:with_inputs")
    assert type(model).__name__ == "TwoInputs" and x.shape == (2, 6) and ids.shape == (2,)
    _, (ids, mask, labels) = load_target(f"{lm_file}:with_kwargs")
    assert mask is None and labels is ids  # a skipped parameter takes its default
    _, (ids, mask, labels) = load_target(f"{lm_file}:with_args_and_kwargs")
    assert labels is ids
    _, (ids,) = load_target(f"{lm_file}:with_one_tensor", input_shape=(2, 3))
    assert ids.shape == (2, 3) and ids.dtype == torch.int64  # replaced like the factory's own
    with pytest.raises(InputError, match=r"gave a tuple of 4 items, not an nn.Module"):
        load_target(f"{lm_file}:broken")
    with pytest.raises(InputError, match=r"raised ValueError: no weights here"):
        load_target(f"{lm_file}:raises")
    code, out, err = run(["check", f"{lm_file}:with_kwargs", "--seeds", "0"], capsys)
    assert code == 0 and "equivalent: 2 of 2 runs match" in out, err
    code, _, err = run(["check", f"{lm_file}:TinyLM"], capsys)
    assert code == 2 and "needs example inputs" in err and "--input" in err


# --- item 9: help and wording ------------------------------------------------------------------

def test_help_is_for_users_and_every_option_says_what_it_does(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert out.split("\n\n")[1].startswith("fxopt rewrites a PyTorch model")
    assert "argparse" not in out and "No logic of its own" not in out
    subparsers = parser._subparsers._group_actions[0].choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"fxopt {name} {action.option_strings or action.dest} has no help"
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert "--input [NAME=]SHAPE[:DTYPE[:LOW-HIGH]]" in out and "--int-range LOW,HIGH" in out
    assert "--device DEVICE" in out and "labels=@input_ids" in out


def test_optimize_takes_where_to_verify_the_budget_check_and_the_outputs(capsys):
    code, out, err = run(["optimize", "zoo:unet", "--input-shape", "8,3,32,32", "--memory-budget", "0.7",
                          "--verify-at",
                          "reduced", "--check-budget", "--outputs", "loss", "--repeats", "1",
                          "--threads", "1"], capsys)
    assert code == 0, err
    assert "; ran at batch 4 of 8 on cpu" in out, out
    assert "budget check: budget" in out and "measured" in out
    assert "loss only" in out  # the training step planned for
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["optimize", "zoo:mlp", "--verify-at", "somewhere"])
    assert exit_info.value.code == 2 and "--verify-at" in capsys.readouterr().err
