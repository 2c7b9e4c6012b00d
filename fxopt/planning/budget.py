"""Memory budgets as users write them: bytes, "2GiB" / "300MB", a fraction of activations, or
"min" (the least memory the checkpoint pass can reach, whatever it costs in time)."""

from __future__ import annotations

import re

from torch import nn

from fxopt.core.errors import ConfigError
from fxopt.core.tensors import tensor_bytes

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_GROUPED = re.compile(r"^\s*[0-9]{1,3}(,[0-9]{3})+(?![0-9,])")


MIN = "min"


def is_min(budget: object) -> bool:
    """Whether ``budget`` asks for the least-memory plan."""
    return isinstance(budget, str) and budget.strip().lower() == MIN


def parse_budget(budget: int | float | str) -> tuple[str, float]:
    """``("bytes", n)``, ``("fraction", f)`` with 0 < f <= 1, or ``("min", 0.0)``; anything else
    is a ConfigError.

    A bare number in (0, 1] is a fraction; an int or a number with a unit is bytes.
    """
    if is_min(budget):
        return MIN, 0.0
    if isinstance(budget, bool):
        raise ConfigError(f"memory budget {budget!r} is not a size",
                          hint="give bytes (int), a size such as '2GiB', or a fraction 0 < f <= 1")
    if isinstance(budget, int):
        value, unit = float(budget), "b"
    elif isinstance(budget, float):
        value, unit = budget, ""
    else:
        # bytes as fxopt's own messages print them ("4,899,688") paste back
        match = _SIZE.match(_GROUPED.sub(lambda m: m.group(0).replace(",", ""), str(budget)))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"cannot read memory budget {budget!r}",
                hint="write bytes (e.g. 2147483648), a size with a unit (300MB, 2GiB), "
                "a fraction of activation memory (0.5), or 'min' for the least memory",
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and 0 < value <= 1:
        return "fraction", value
    if unit == "" and not value.is_integer():
        raise ConfigError(f"memory budget {budget!r} is neither a fraction in (0, 1] nor bytes",
                          hint="use 0 < f <= 1 for a fraction, or a whole number of bytes")
    if value <= 0:
        raise ConfigError(f"memory budget {budget!r} must be positive",
                          hint="give a fraction 0 < f <= 1 of the activation memory, or bytes "
                               "such as 2GiB")
    return "bytes", value * _UNITS[unit or "b"]


def trainable_grad_bytes(module: nn.Module) -> int:
    """Bytes of the gradients a training step allocates for ``module``'s trainable parameters."""
    return tensor_bytes([p for p in module.parameters() if p.requires_grad])


def activation_bytes(peak: int, baseline: int, grad_bytes: int) -> int:
    """What a budget fraction is a fraction of: the training peak minus what checkpointing
    cannot remove (parameters, buffers and inputs -- the baseline -- and ``grad_bytes``, the
    parameter gradients alive at the peak; ``fxopt.analysis.estimate.TrainPeak`` gives both)."""
    return max(peak - baseline - grad_bytes, 0)


def budget_bytes(budget: int | float | str, *, peak: int, activations: int) -> int:
    """The budget in bytes; a fraction f keeps f of the activations: ``peak - (1 - f) * act``;
    "min" is 0 (the caller looks for the least-memory plan instead)."""
    kind, value = parse_budget(budget)
    if kind == MIN:
        return 0
    if kind == "bytes":
        return int(value)
    return int(peak - (1 - value) * activations)


def budget_fraction(budget: int | float | str, *, peak: int, activations: int) -> float:
    """The budget as a fraction of activation memory (clamped to [0, 1]), for tools taking one."""
    kind, value = parse_budget(budget)
    if kind in ("fraction", MIN):
        return value
    if activations <= 0:
        return 1.0
    return min(max(1 - (peak - value) / activations, 0.0), 1.0)
