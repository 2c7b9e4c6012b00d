"""fxopt.planning.budget: memory budgets as users write them, and what a fraction is of."""

import pytest
import torch
from torch import nn

from fxopt.core.errors import ConfigError
from fxopt.planning.budget import (
    activation_bytes,
    budget_bytes,
    budget_fraction,
    parse_budget,
    trainable_grad_bytes,
)


@pytest.mark.parametrize("budget, expected", [
    ("2GiB", ("bytes", 2 * 2**30)),
    ("300MB", ("bytes", 300 * 10**6)),
    ("300mb", ("bytes", 300 * 10**6)),
    (" 64 KiB ", ("bytes", 64 * 1024)),
    ("1.5MiB", ("bytes", 1.5 * 2**20)),
    ("0.5GiB", ("bytes", 2**29)),       # a unit makes it bytes, even below 1
    ("1TB", ("bytes", 10**12)),
    ("4096B", ("bytes", 4096)),
    ("4096", ("bytes", 4096)),           # a whole number without unit: bytes
    (4096, ("bytes", 4096)),
    (1, ("bytes", 1)),                   # an int is bytes, even 1
    (0.5, ("fraction", 0.5)),
    (1.0, ("fraction", 1.0)),
    ("0.25", ("fraction", 0.25)),
    ("1", ("fraction", 1.0)),            # a bare number in (0, 1] (CLI strings): a fraction
    (".75", ("fraction", 0.75)),
    (3.0, ("bytes", 3)),                 # a whole float above 1: bytes
    ("min", ("min", 0.0)),               # the least-memory plan
    ("4,899,688", ("bytes", 4899688)),   # as BudgetError prints it
    ("1,000", ("bytes", 1000)),
    (" MIN ", ("min", 0.0)),
])
def test_parse_budget(budget, expected):
    assert parse_budget(budget) == expected


@pytest.mark.parametrize("budget", ["", "lots", "2 GiBs", "2XB", "1e9", "-1", "-0.5",
                                    "2GiB 3MB", "GiB", "0x10", "1,00", "12,3456", None])
def test_unreadable_budgets_are_config_errors_with_a_hint(budget):
    with pytest.raises(ConfigError) as info:
        parse_budget(budget)
    assert "cannot read memory budget" in str(info.value)
    assert repr(budget) in info.value.what
    assert "2GiB" in info.value.hint and "0.5" in info.value.hint  # examples of what works


@pytest.mark.parametrize("budget", [1.5, 2.25, "1.5", -0.5])
def test_neither_fraction_nor_whole_bytes(budget):
    with pytest.raises(ConfigError, match="neither a fraction in") as info:
        parse_budget(budget)
    assert info.value.hint and "0 < f <= 1" in info.value.hint


@pytest.mark.parametrize("budget", [True, False])
def test_booleans_are_not_sizes(budget):
    with pytest.raises(ConfigError, match="is not a size") as info:
        parse_budget(budget)
    assert "2GiB" in info.value.hint


@pytest.mark.parametrize("budget", [0, -1, 0.0, "0", "0MB"])
def test_zero_and_negative_budgets_are_refused(budget):
    with pytest.raises(ConfigError, match="must be positive"):
        parse_budget(budget)


@pytest.mark.parametrize("budget", [0, "0MB"])
def test_non_positive_budget_errors_carry_a_hint(budget):
    with pytest.raises(ConfigError) as info:
        parse_budget(budget)
    assert info.value.hint


def test_budget_bytes_keeps_a_fraction_of_the_activations():
    peak, activations = 1000, 600  # 400 bytes no rewrite can remove
    assert budget_bytes(0.5, peak=peak, activations=activations) == 700
    assert budget_bytes(1.0, peak=peak, activations=activations) == peak
    assert budget_bytes("0.25", peak=peak, activations=activations) == 550
    assert budget_bytes("1KiB", peak=peak, activations=activations) == 1024
    assert budget_bytes(800, peak=peak, activations=activations) == 800
    assert isinstance(budget_bytes("1.5KiB", peak=peak, activations=activations), int)
    with pytest.raises(ConfigError):
        budget_bytes("half", peak=peak, activations=activations)


def test_budget_fraction_is_the_inverse_clamped():
    peak, activations = 1000, 600
    assert budget_fraction(0.3, peak=peak, activations=activations) == 0.3
    assert budget_fraction(700, peak=peak, activations=activations) == pytest.approx(0.5)
    assert budget_fraction(budget_bytes(0.8, peak=peak, activations=activations), peak=peak,
                           activations=activations) == pytest.approx(0.8)
    assert budget_fraction(5000, peak=peak, activations=activations) == 1.0   # above the peak
    assert budget_fraction(100, peak=peak, activations=activations) == 0.0    # below the floor
    assert budget_fraction(500, peak=peak, activations=0) == 1.0              # nothing to save


def test_activation_bytes_is_what_remains_and_never_negative():
    assert activation_bytes(1000, 300, 100) == 600
    assert activation_bytes(300, 300, 100) == 0


def test_trainable_grad_bytes_counts_trainable_parameters_once():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False))
    assert trainable_grad_bytes(model) == (4 * 3 + 3 + 3 * 2) * 4
    model[0].weight.requires_grad_(False)
    assert trainable_grad_bytes(model) == (3 + 3 * 2) * 4
    model[1].weight = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
    assert trainable_grad_bytes(model) == 3 * 4 + 6 * 2  # element sizes by dtype

    tied = nn.Module()
    tied.a = nn.Linear(5, 5, bias=False)
    tied.b = nn.Linear(5, 5, bias=False)
    tied.b.weight = tied.a.weight
    assert trainable_grad_bytes(tied) == 25 * 4  # one gradient for a shared weight
