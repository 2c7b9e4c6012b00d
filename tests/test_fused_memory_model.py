"""The memory model knows about the optimizer step fused into backward (issue 15, item 3).

- ``estimate_peak`` of a fused model equals a real fused training step measured on CPU, byte for
  byte, for the for-loop, foreach and fused AdamW kernels (their temporaries differ); it tells
  the gradients and the step's temporaries alive at the peak from activations.
- The checkpoint planner plans with gradients freed: budgets a model cannot meet with every
  gradient alive are met once its optimizer is fused (torchvision's resnet18 and vgg11_bn, the
  two rows of the coverage sweep that raise BudgetError at 0.7).
- ``max_batch_size`` sees it; the report shows the gradients at the peak and the optimizer state.
- fxopt's own real runs (verify, measure, optimize) never step a fused optimizer: the user's
  parameters and optimizer state are as before.
- The fused optimizer is an explicit input (``fused_optimizer=``): one alive in the process but
  not named by the call changes neither an estimate nor a plan (issue 26).
"""

from __future__ import annotations

import pytest
import torch
import torchvision

import fxopt
from fxopt.core.training_setup import TrainingSetup
from fxopt.analysis.estimate import estimate_peak, estimate_train_peak, max_batch_size
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.core.errors import BudgetError
from fxopt.core.step import training_step
from fxopt.runtime.fused_step import MAX_STEP_SLICES
from helpers import WideMLP, seeded


@pytest.fixture
def fusing():
    """``fuse(model, **adamw_options)``; every fused optimizer is removed after the test."""
    made = []

    def fuse(model, **kwargs):
        made.append(fxopt.fuse_optimizer(model, torch.optim.AdamW, lr=1e-3, **kwargs))
        return made[-1]

    yield fuse
    for fused in made:
        fused.remove()


def _estimated_and_measured(model, x, fused):
    """The estimate of a fused training step of ``model``, checked to the byte against a real
    step measured on CPU (after step 1, which creates AdamW's moments)."""
    training_step(model, x)
    fused.step()
    estimate = estimate_peak(model, x, fused_optimizer=fused)
    tracker = LiveStorageTracker()
    with tracker:
        training_step(model, x)
        fused.step()
    assert estimate.train_bytes - estimate.baseline_bytes == tracker.peak_bytes
    return estimate


@pytest.mark.parametrize("kwargs", [{}, {"foreach": True}, {"fused": True}],
                         ids=["for_loop", "foreach", "fused_kernel"])
def test_the_estimate_equals_a_real_fused_step(kwargs, fusing):
    model, x = seeded(WideMLP, 512), torch.randn(2, 512)
    fused = fusing(model, **kwargs)
    estimate = _estimated_and_measured(model, x, fused)
    assert estimate.fused_parameters == 12
    assert estimate.optimizer_state_bytes == pytest.approx(
        2 * sum(p.numel() * 4 for p in model.parameters()), rel=0.01)  # exp_avg, exp_avg_sq
    # at most one 1 MiB weight's gradient is alive at the peak; the rest was freed at its step
    assert estimate.train_grad_bytes <= 512 * 512 * 4 + 2**20
    temporaries = {"foreach": 1, "fused": 0}.get(next(iter(kwargs), ""), 2)
    assert estimate.train_optimizer_step_bytes == temporaries * 512 * 512 * 4


@pytest.mark.parametrize("slice_bytes", [0, 2**18, 2**12],
                         ids=["whole", "quarter_slices", "at_most_16_slices"])
def test_a_parameter_stepped_in_slices_holds_a_slices_temporaries(slice_bytes, fusing):
    """AdamW's for-loop step allocates two temporaries the size of what it steps: a 1 MiB weight
    stepped in 256 KiB slices holds two of 256 KiB, and the estimate says so to the byte. Slices
    of 4 KiB would be 256 optimizer calls: it is cut into 16 of 64 KiB instead."""
    model, x = seeded(WideMLP, 512), torch.randn(2, 512)
    fused = fusing(model, step_slice_bytes=slice_bytes)
    estimate = _estimated_and_measured(model, x, fused)
    whole = 512 * 512 * 4
    sliced = max(slice_bytes, whole // MAX_STEP_SLICES) if slice_bytes else whole
    assert estimate.train_optimizer_step_bytes == 2 * sliced


def test_without_a_fused_optimizer_every_gradient_is_counted(fusing):
    model, x = seeded(WideMLP, 512), torch.randn(2, 512)
    plain = estimate_peak(model, x)
    assert plain.train_grad_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert plain.fused_parameters == 0 and plain.train_optimizer_step_bytes == 0
    fused = fusing(model, fused=True)
    assert estimate_peak(model, x, fused_optimizer=fused).train_bytes < (
        plain.train_bytes - 4 * 2**20)


@pytest.mark.parametrize("name", ["resnet18", "vgg11_bn"])
def test_a_budget_out_of_reach_with_every_gradient_alive_is_met_once_fused(name, fusing):
    model = seeded(getattr(torchvision.models, name))
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(BudgetError):
        fxopt.optimize(model, x, memory_budget=0.7, verify=False)
    fused = fusing(model)
    before = [p.detach().clone() for p in model.parameters()]
    slim = fxopt.optimize(model, x, memory_budget=0.7, fused_optimizer=fused)  # verified
    report = slim.fxopt_report
    assert report.predicted_after.train_bytes < report.predicted_before.train_bytes
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not fused.optimizer.state  # fxopt's runs stepped nothing


def test_fxopts_own_runs_never_step_a_fused_optimizer(fusing):
    model, x = seeded(WideMLP), torch.randn(2, 256)
    fused = fusing(model)
    before = [p.detach().clone() for p in model.parameters()]
    fxopt.measure(model, x)
    slim = fxopt.optimize(model, x, measure_memory=True, fused_optimizer=fused)
    fxopt.verify(model, slim, x)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not fused.optimizer.state and all(p.grad is None for p in model.parameters())
    training_step(slim, x)  # the user's training still steps in backward, on either module
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_max_batch_size_counts_gradients_freed_in_backward(fusing):
    model, x = seeded(WideMLP, 512), torch.randn(2, 512)
    budget = estimate_peak(model, torch.randn(64, 512)).train_bytes
    plain = max_batch_size(model, x, budget)
    fused = fusing(model, fused=True)
    assert max_batch_size(model, x, budget) == plain  # not told of it
    assert max_batch_size(model, x, budget, fused_optimizer=fused) > plain


def test_the_report_shows_gradients_at_the_peak_and_the_optimizer_state(fusing):
    model, x = seeded(WideMLP), torch.randn(2, 256)
    plain = str(fxopt.optimize(model, x, verify=False).fxopt_report)
    assert "gradients at it, predicted" in plain and "fused optimizer step:" not in plain
    fused = fusing(model)
    text = str(fxopt.optimize(model, x, verify=False, fused_optimizer=fused).fxopt_report)
    assert "fused optimizer step: 12 parameters stepped in backward" in text
    assert "optimizer state 3.0 MiB" in text, text


def test_the_cli_plans_and_reports_with_a_fused_optimizer(capsys):
    from fxopt import cli
    code = cli.main(["report", "zoo:mlp", "--fuse-optimizer", "AdamW", "--no-plot"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "with the optimizer step fused into backward" in out
    assert "optimizer state (alive throughout, not in the peaks)" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["optimize", "zoo:mlp", "--fuse-optimizer", "adamx"])
    assert exit_info.value.code == 2
    assert "'adamx' is no torch.optim optimizer" in capsys.readouterr().err


class ScaledSGD(torch.optim.Optimizer):
    """A custom optimizer whose constructor needs a positional argument the fake run cannot
    supply from its param groups."""

    def __init__(self, params, scale, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * self.scale, alpha=-group["lr"])


def test_an_optimizer_the_fake_run_cannot_rebuild_still_frees_its_gradients():
    model, x = seeded(WideMLP, 512), torch.randn(2, 512)
    plain = estimate_peak(model, x)
    fused = fxopt.fuse_optimizer(model, lambda params: ScaledSGD(params, 0.5))
    try:
        estimate = estimate_train_peak(model, x, training=TrainingSetup(fused_optimizer=fused))
    finally:
        fused.remove()
    assert estimate.fused.parameters == 12 and not estimate.fused.temporaries_modelled
    assert estimate.grad_bytes <= 512 * 512 * 4 + 2**20
    assert estimate.bytes < plain.train_bytes


def test_the_cli_meets_a_budget_with_the_fused_step_and_exports(tmp_path, capsys):
    from fxopt import cli
    argv = ["optimize", "zoo:resnet18", "--input-shape", "2,3,64,64", "--memory-budget", "0.7",
            "--repeats", "1", "--threads", "1"]
    assert cli.main(argv) == 2  # BudgetError: a usage error whose hint names the fused step
    assert "parameter gradients, which checkpointing cannot free" in capsys.readouterr().err
    code = cli.main(argv + ["--fuse-optimizer", "adamw", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "fused optimizer step: 62 parameters stepped in backward" in out
    assert (tmp_path / "out" / "state_dict.pt").exists()


def test_only_the_fused_optimizer_the_call_names_changes_the_estimate_and_the_plan(fusing):
    """No hidden global input: a fused optimizer alive in the process, for an unrelated model or
    for this very one, changes nothing until the call is given it."""
    from fxopt.capture.trace import trace
    from fxopt.planning.checkpoint_problem import build_problem

    model, x = seeded(WideMLP, 512), torch.randn(2, 512)
    gm = trace(model, x)

    def plan_grads(fused_optimizer=None):
        problem, _ = build_problem(gm, profile=False,
                                   training=TrainingSetup(fused_optimizer=fused_optimizer))
        return [info.grad_bytes for info in problem.nodes]

    plain, plain_grads = estimate_peak(model, x), plan_grads()
    unrelated = fusing(seeded(WideMLP, 512), fused=True)
    assert estimate_peak(model, x) == plain and plan_grads() == plain_grads
    assert estimate_peak(model, x, fused_optimizer=unrelated) == plain
    assert plan_grads(fused_optimizer=unrelated) == plain_grads
    own = fusing(model, fused=True)  # alive, hooked on model's parameters, not named
    assert estimate_peak(model, x) == plain and plan_grads() == plain_grads
    assert estimate_peak(gm, x, fused_optimizer=own).train_bytes < plain.train_bytes
    assert sum(plan_grads(fused_optimizer=[own, unrelated])) == 0 < sum(plain_grads)
