"""fxopt.measure.allocations, fxopt.bench.peers and fxopt.bench: peers built faithfully, measured honestly."""

import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import fxopt
from fxopt.bench.peers import build_peer, single_value_cuts
from fxopt.bench.before_after import PEAK_DEFINITION, BeforeAfter
from fxopt.bench.environment import code_commit, imported_checkout
from fxopt.bench.runs import bench, format_table, step_peak_bytes
from fxopt.bench.spread import StepTimes, TimeChange
from fxopt.capture.trace import trace
from fxopt.measure.allocations import peak_allocated_during
from fxopt.measure.peaks import measure_train_step
from fxopt.verify.equivalence import verify


def test_allocator_peak_sees_a_temporary_and_its_free():
    def run():
        a = torch.empty(256, 1024)      # 1 MiB
        b = torch.empty(128, 1024)      # 0.5 MiB, while a is alive
        del a, b
        torch.empty(64, 1024)           # 0.25 MiB after both are freed

    peak = peak_allocated_during(run, torch.device("cpu"))
    assert 1.5 * 2**20 <= peak < 1.5 * 2**20 + 4096


def conv_bn_chain() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) + x  # x stays alive across a and b: no cut inside


def test_single_value_cuts_skip_points_where_a_residual_is_alive():
    gm = trace(Residual(), (torch.randn(2, 4),))
    assert [n.name for n in single_value_cuts(gm)] == ["x", "add"]


def test_checkpoint_sequential_peer_is_sqrt_n_and_its_batchnorm_flaw_is_reported():
    model, x = conv_bn_chain(), torch.randn(4, 3, 16, 16)
    peer, note = build_peer("checkpoint_sequential", model, (x,), 1.0)
    stages = len(peer.stages)
    assert stages == 16 and peer.segments == 4, note  # every op is a stage of a plain chain
    assert [id(p) for p in peer.parameters()] == [id(p) for p in model.parameters()]
    assert measure_train_step(peer, (x,)).peak_bytes < measure_train_step(model, (x,)).peak_bytes
    report = verify(model, peer, (x,))
    # recomputation runs BatchNorm's statistics update a second time: fxopt does not hide that
    assert not report.ok and {m.kind for m in report.mismatches} == {"buffer"}


def test_bench_rows_original_first_fxopt_equal_and_step_peak_measured():
    model, x = conv_bn_chain(), torch.randn(8, 3, 32, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = bench(model, (x,), memory_budget=0.8, peers=("checkpoint_sequential",), repeats=1)
    assert [r.name for r in rows] == ["original", "fxopt", "checkpoint_sequential"]
    original, ours, peer = rows
    assert original.memory_ratio == 1.0 and original.step_seconds > 0
    assert original.time_ratio == 1.0 and original.time_within_noise is None
    assert ours.equivalent is True and ours.train_peak_bytes < original.train_peak_bytes
    assert peer.equivalent is False and "buffer" in peer.note
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    table = format_table(rows)
    assert "device: cpu" in table and "NO" in table


def test_step_peak_of_a_compiled_peer_is_measured_inside_the_compiled_graph():
    model, x = conv_bn_chain(), torch.randn(8, 3, 32, 32)
    peer, note = build_peer("torch_compile_min_cut", model, (x,), 0.5)
    assert "aot_eager_decomp_partition" in note
    eager = step_peak_bytes(model, (x,))
    compiled = step_peak_bytes(peer, (x,))
    assert compiled > 0 and compiled != eager  # a different program: decomposed, partitioned


def test_compiled_peers_leave_the_users_compiled_code_alone():
    """Nothing resets torch.compile's caches: a function the user compiled before the benchmark
    does not compile again after it."""
    user_compiles = []

    def users_backend(gm, example_inputs):
        user_compiles.append(gm)
        return gm.forward

    users_function = torch.compile(lambda x: x.sin() + 1, backend=users_backend)
    users_function(torch.randn(3))
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 8)
    for fraction in (1.0, 0.0):
        peer, _ = build_peer("torch_compile_min_cut", model, (x,), fraction)
        peer(x).sum().backward()
    users_function(torch.randn(3))
    assert len(user_compiles) == 1  # torch._dynamo.reset() would make it 2


def test_a_change_smaller_than_the_spread_is_flagged_within_noise():
    quiet = StepTimes((0.100, 0.101, 0.102, 0.101, 0.100))
    slower = StepTimes((0.150, 0.151, 0.152, 0.150, 0.151))
    assert (quiet.fastest, quiet.median, quiet.slowest) == (0.100, 0.101, 0.102)
    real = TimeChange(quiet, slower)
    assert real.change == pytest.approx(0.495, abs=1e-3) and not real.within_noise
    assert real.percent() == "+49.5%" and real.noise_line() == ""
    # the +691% of a busy machine: two bursts among five samples of each model
    busy = TimeChange(StepTimes((0.30, 0.31, 0.30, 2.40, 2.00)),
                      StepTimes((0.35, 2.50, 2.60, 0.36, 2.40)))
    assert busy.change > 5 and busy.within_noise and busy.percent().endswith("%?")
    assert "within this run's noise" in busy.noise_line()
    # hundreds of millisecond steps: one outlier does not make a threefold slowdown noise
    steady = [0.0010 + 0.00001 * (i % 7) for i in range(200)]
    outlier = StepTimes(tuple(steady[:-1] + [0.0100]))
    assert not TimeChange(outlier, StepTimes(tuple(3 * t for t in steady))).within_noise
    assert TimeChange(outlier, StepTimes(tuple(t * 1.001 for t in steady))).within_noise


def test_the_optimize_table_shows_the_spread_and_flags_noise():
    from fxopt.measure.compare import Comparison, Figures

    figures = Figures(2**20, 2**20, 2**19, 2**19, 0.101)
    comparison = Comparison(figures, figures, "cpu", "live-storage tracking (exact)", 5)
    busy = TimeChange(StepTimes((0.30, 0.31, 0.30, 2.40, 2.00)),
                      StepTimes((0.35, 2.50, 2.60, 0.36, 2.40)))
    text = str(BeforeAfter(comparison, busy, threads=1))
    assert "train step, fastest of 5" in text and "train step, slowest of 5" in text
    assert "+674.2%?" in text and "within this run's noise" in text
    assert PEAK_DEFINITION in text and "1 torch thread;" in text
    quiet = TimeChange(StepTimes((0.100, 0.101, 0.102)), StepTimes((0.150, 0.151, 0.152)))
    text = str(BeforeAfter(comparison, quiet, threads=2))
    assert "+49.5%" in text and "?" not in text and "noise" not in text


def test_bench_ratios_agree_with_the_figures_printed_beside_them():
    model, x = conv_bn_chain(), torch.randn(4, 3, 16, 16)
    rows = bench(model, (x,), memory_budget=0.8, peers=("checkpoint_sequential",), repeats=3)
    original = rows[0]
    for row in rows:
        assert row.time_ratio == row.step_seconds / original.step_seconds  # one timing run
        assert row.memory_ratio == row.train_peak_bytes / original.train_peak_bytes
        assert row.step_fastest_seconds <= row.step_seconds <= row.step_slowest_seconds
        assert row.step_samples == original.step_samples >= 3
    table = format_table(rows, "cpu")
    printed = {}
    for line in table.splitlines()[1:len(rows) + 1]:
        name, _peak, unit, mem, times, ratio = line.split()[:6]
        printed[name] = (float(mem), float(times.split("/")[1]), float(ratio.rstrip("?")))
    for name, (_, median, ratio) in printed.items():
        # the printed medians carry 4 significant digits and the ratio 2 decimals: on a loaded
        # machine a ratio of hundreds inherits the medians' rounding (relative 1e-3)
        assert ratio == pytest.approx(median / printed["original"][1], rel=1e-3, abs=0.011), name
    assert f"train peak: {PEAK_DEFINITION}" in table


def test_bench_train_peak_includes_parameters_as_optimize_does():
    """One definition of the training peak: the whole step, the baseline of parameters, buffers
    and inputs included, in ``fxopt bench`` as in ``fxopt optimize`` (``fxopt.measure``)."""
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))  # 1 MiB of weights
    x = torch.randn(4, 512)
    rows = bench(model, (x,), peers=(), repeats=1)
    measured = measure_train_step(model, (x,))
    original = rows[0]
    assert original.baseline_bytes == measured.baseline_bytes > 2**20
    # the same measurement: bench reads fxopt.measure_train_step (it used to read the allocator,
    # a few kilobytes of kernel scratch more, and disagreed with optimize's report)
    assert original.train_peak_bytes == measured.peak_bytes


def test_results_name_the_commit_of_the_fxopt_that_ran(tmp_path):
    """A results header names the checkout the imported ``fxopt`` came from (an A/B through
    ``PYTHONPATH`` names each side's own commit), and says when its code differs from it."""
    assert imported_checkout() / "fxopt" / "__init__.py" == Path(fxopt.__file__).resolve()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    (tmp_path / "fxopt").mkdir()
    (tmp_path / "fxopt" / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True, text=True,
                         capture_output=True).stdout.strip()
    assert code_commit(tmp_path) == sha
    (tmp_path / "fxopt" / "a.py").write_text("x = 2\n")
    assert code_commit(tmp_path) == f"{sha}+changes"
