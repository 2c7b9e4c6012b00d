"""benchmarks/cuda_suite.py: its plan, its refusal without a GPU, the benchmarks' --device flags,
and how it runs steps (pass, failure, time limit) -- all on the CPU, with stand-in steps."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "cuda_suite.py"


def load(path: Path):
    """The benchmark script at ``path`` as a module (its main() is not run)."""
    name = f"_bench_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    return sys.modules[name]


suite = load(SUITE)


def script_steps():
    """(script path, its arguments) of every suite step that runs a benchmark script."""
    return [(ROOT / step.argv[1], list(step.argv[2:])) for part in suite.plan()
            for step in part.steps if step.argv[1].startswith("benchmarks/")]


def test_dry_run_lists_every_part_its_commands_and_limits_and_runs_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for key, result in [("tests", "tests"), ("estimate", "estimate_accuracy"),
                        ("lm", "lm_memory"), ("main", "main_job"),
                        ("pad", "pad_channels"), ("sweep", "checkpoint_sweep"),
                        ("hf", "hf_checkpointing")]:
        assert f"\n{key} -> {result}_cuda.txt" in out
    for part in suite.plan():
        for step in part.steps:
            assert suite.command_line(step) in out
    assert out.count("[limit ") == sum(len(p.steps) for p in suite.plan())
    assert "-m pytest" in out and "--device cuda" in out and "dry run: nothing was run" in out
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_only_selects_parts_and_an_unknown_part_is_a_usage_error(capsys):
    assert suite.main(["--dry-run", "--only", "pad,hf", "--budget-seconds", "100"]) == 0
    out = capsys.readouterr().out
    assert "pad -> " in out and "hf -> " in out and "sweep -> " not in out
    assert "limit 40 s" in out and "limit 60 s" in out  # shares 60:90 of 100 s
    with pytest.raises(SystemExit) as exit_:
        suite.main(["--dry-run", "--only", "pad,nope"])
    assert exit_.value.code == 2 and "unknown part(s) nope" in capsys.readouterr().err


def test_without_cuda_the_real_run_exits_2_saying_why(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    out = tmp_path / "out"
    assert suite.main(["--out", str(out)]) == suite.NO_CUDA_EXIT == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "torch.cuda.is_available() is False" in err
    assert "--dry-run" in err and not out.exists()


def test_without_cuda_the_script_itself_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, str(SUITE), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no CUDA device" in done.stderr


def test_every_benchmark_step_parses_its_arguments_and_takes_device_cpu_or_cuda():
    steps = script_steps()
    assert {path.name for path, _ in steps} == {
        "estimate_accuracy.py", "lm_memory.py", "pad_channels.py", "checkpoint_sweep.py",
        "hf_checkpointing.py"}
    for path, arguments in steps:
        if path.name in ("hf_checkpointing.py", "lm_memory.py"):
            pytest.importorskip("transformers")
        parser = load(path).build_parser()
        args = parser.parse_args(arguments)  # every flag the suite passes exists
        assert args.device == "cuda", path.name
        assert parser.parse_args(["--device", "cpu"]).device == "cpu"


def test_the_main_job_step_is_the_readme_command_on_cuda_and_parses():
    from fxopt.cli.commands import build_parser

    main_job, = [step for part in suite.plan() if part.key == "main" for step in part.steps]
    assert main_job.argv[1:3] == ("-m", "fxopt")
    args = build_parser().parse_args(list(main_job.argv[3:]))
    assert args.device == "cuda" and args.memory_budget == "0.6"


def test_the_lm_part_runs_its_gpu_arms_with_a_stand_in_allocator(monkeypatch, capsys):
    """The GPU table's code path (one arm at a time, the allocator's peak over the steps,
    losses against the original's) on the CPU, with torch.cuda's readers stood in: a GPU
    session must not be the first to run it."""
    pytest.importorskip("transformers")
    lm = load(ROOT / "benchmarks" / "lm_memory.py")
    readings = iter(range(1, 10**6))
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: next(readings) * 2**20)
    args = lm.parse(["--device", "cpu", "--dtype", "bfloat16", "--models", "llama",
                     "--hidden", "32", "--layers", "1", "--seq", "32", "--vocab", "600",
                     "--steps", "2", "--arms", "original,hf_gc,hf_gc_liger,min_loss_fused",
                     "--static-shapes"])  # as the suite runs it
    lm.run_model_on_gpu("llama", args, print)
    out = capsys.readouterr().out
    assert "hf_gc_liger: left out" in out  # no Liger without a GPU
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in ("original", "hf_gc", "min_loss_fused")}
    assert set(rows) == {"original", "hf_gc", "min_loss_fused"}
    assert "bfloat16 on cpu" in out and "verified at" in rows["min_loss_fused"]
    assert "(static shapes)" in rows["min_loss_fused"]


def test_the_sweep_has_cuda_inputs_for_every_model_it_runs():
    sweep = load(ROOT / "benchmarks" / "checkpoint_sweep.py")
    assert set(sweep.CUDA_INPUTS) == set(sweep.INPUTS)
    for path, arguments in script_steps():
        if path.name == "checkpoint_sweep.py":
            models = arguments[arguments.index("--models") + 1].split(",")
            assert set(models) <= set(sweep.CUDA_INPUTS)


def test_the_test_step_names_every_test_that_needs_cuda_and_only_existing_ones():
    ids = suite.cuda_tests()
    assert "tests/test_measure.py::test_cuda_allocator_figure" in ids
    # skipped without a GPU but not marked cuda: -m cuda alone would miss it
    assert ("tests/test_core_tensors.py::test_cuda_peak_during_is_the_allocator_peak_above_the_"
            "start") in ids
    for node in ids:
        path, name = node.split("::")[:2]
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        assert name in {getattr(n, "name", None) for n in tree.body}, node
    assert "tests/test_cuda_suite.py" not in " ".join(ids)
    argv = suite.plan()[0].steps[0].argv
    assert argv[1:3] == ("-m", "pytest") and tuple(ids) == argv[-len(ids):]


def test_the_cuda_tests_run_on_the_cpu_until_they_need_the_device():
    """``benchmarks/cuda_tests_on_cpu.py``: every CUDA test's body runs on the CPU until it needs
    the device, and none fails otherwise (token ids past a vocabulary, a wrong name): what would
    cost a GPU session's minutes is caught here. Its sorting of failures is checked on the
    three kinds of message it meets."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the CUDA tests run for real (benchmarks/cuda_suite.py)")
    dry = load(ROOT / "benchmarks" / "cuda_tests_on_cpu.py")
    assert dry.group_of("RuntimeError: Found no NVIDIA driver on your system.") == dry.GROUPS[0]
    assert dry.group_of("Failed: DID NOT RAISE InputError") == dry.GROUPS[1]
    assert dry.group_of("AssertionError: assert False") == dry.GROUPS[1]
    assert dry.group_of("fxopt.runtime.errors.InputError: verify: the reference raised "
                        "IndexError in its train-mode forward") == dry.GROUPS[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_tests_on_cpu.py")],
                         cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "look at it: 0" in run.stdout and "needs the device:" in run.stdout


def test_limits_share_what_is_left_so_savings_go_to_later_steps():
    a, b, c = suite.Step(("python",), 50), suite.Step(("python",), 150), suite.Step(("python",), 100)
    assert suite.limit_for(a, [b, c], 300) == pytest.approx(50)
    assert suite.limit_for(b, [c], 290) == pytest.approx(174)  # a took 10 s of its 50
    assert suite.limit_for(c, [], 5) == pytest.approx(5)
    assert suite.limit_for(c, [], -3) == 0.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_steps_run_with_headers_statuses_and_a_time_limit_that_ends_the_whole_step(
        tmp_path, capsys, monkeypatch):
    # A step that starts a grandchild and hangs: at its limit both must end.
    hang = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)']); print('grandchild', child.pid, flush=True); "
            "time.sleep(120)")
    skipping = tmp_path / "test_skips.py"
    skipping.write_text("import pytest\n\ndef test_needs_a_gpu():\n    pytest.skip('no GPU')\n")
    fake = [
        suite.Part("slow", "slow", "a step that hangs", (suite.Step(("python", "-c", hang), 1),)),
        suite.Part("mixed", "mixed", "one passes, one fails", (
            suite.Step(("python", "-c", "import fxopt, os; print('root on path', os.getcwd())"),
                       100),
            suite.Step(("python", "-c", "import sys; print('failing'); sys.exit(3)"), 100),
            suite.Step(("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(skipping)),
                       100))),
    ]
    monkeypatch.setattr(suite, "plan", lambda: fake)
    monkeypatch.setattr(suite, "cuda_missing", lambda: None)
    monkeypatch.setattr(suite, "environment", lambda: {"device": "Fake GPU (CUDA 0.0)",
                                                       "torch": torch.__version__})
    monkeypatch.setattr(suite, "MIN_STEP_SECONDS", 0.5)
    out = tmp_path / "results"
    started = time.monotonic()
    code = suite.main(["--out", str(out), "--budget-seconds", "602", "--commit", "abc1234"])
    # the hang got 2 s of 602: main returned before the 120 s the hang (or its grandchild, were
    # it left holding the output pipe) would take. The other steps start Python and pytest,
    # seconds on a loaded machine, so the bound is the hang's own length, not a guess at theirs.
    assert code == 1 and time.monotonic() - started < 120
    slow = (out / "slow_cuda.txt").read_text()
    assert slow.startswith("# a step that hangs (cuda_suite part 'slow')\n# date: ")
    assert "# device: Fake GPU (CUDA 0.0)" in slow and "# code: commit abc1234" in slow
    assert "## command: python -c" in slow and "(time limit 2 s)" in slow
    assert "## result: timed out after 2 s (limit 2 s)" in slow
    grandchild = int(slow.split("grandchild ", 1)[1].split()[0])
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
    mixed = (out / "mixed_cuda.txt").read_text()
    assert f"root on path {ROOT}" in mixed and "## result: passed" in mixed
    assert mixed.index("root on path") < mixed.index("failing") < mixed.index(
        "## result: failed (exit 3)")
    summary = (out / "summary_cuda.txt").read_text()
    assert "slow      timed out" in summary and "mixed     failed" in summary
    assert "    passed (1 skipped), " in summary  # a skipped CUDA test is worth a look
    assert "0 of 2 part(s) passed" in summary and "# code: commit abc1234" in summary
    assert sorted(p.name for p in out.iterdir()) == [
        "mixed_cuda.txt", "slow_cuda.txt", "summary_cuda.txt"]
    assert "0 of 2 part(s) passed" in capsys.readouterr().out


def test_commit_falls_back_to_git_or_says_it_is_unknown(monkeypatch):
    assert suite.git_commit("deadbee") == "deadbee"
    monkeypatch.setattr(suite, "ROOT", Path(os.sep))  # no git repository at /
    assert suite.git_commit(None).startswith("unknown (")
