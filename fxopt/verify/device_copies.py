"""Copies of the models on another device, for a proof that cannot run on theirs.

``fxopt.verify.fitting`` proves a rewrite on CPU copies of both models where the original's
training step does not fit the device even at batch 1, where the model's code fixes the batch,
or where the module was captured with ``dynamic=False``. ``copies_on(device, *models)`` makes
them: deep copies whose parameters and buffers are copied straight to ``device``, once each
(what the models share stays shared), so the models' own device never holds a second copy of
the weights.

An export-captured module moves to the CPU when its input guard is portable: no graph of it
names a device type (``fxopt.runtime.input_guard``). When one does (an autocast scope on the
GPU's device type), a copy on the CPU would compute another function, and ``copies_on`` raises
``InputError`` saying what names it and where, before copying anything.

Not handled: an operator that has a kernel on one device type only raises when the copy runs
it, as the original's copy would.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fxopt.capture.export_devices import device_types_built_in
from fxopt.core.errors import InputError
from fxopt.runtime.input_guard import InputGuard


def copies_on(device: torch.device, *models: nn.Module) -> tuple[nn.Module, ...]:
    """Deep copies of ``models`` on ``device`` (what they share stays shared); ``InputError``
    where an export-captured one has its device type built in (the module doc)."""
    for model in models:
        if all(guard.runs_on(device.type) for guard in _guards_in(model)):
            continue
        named = [item for item in device_types_built_in(model) if item[0] != device.type]
        kind, where = named[0] if named else ("its", "a guard saved before fxopt checked for one")
        raise InputError(
            f"{type(model).__name__} was captured by torch.export with the device type {kind} "
            f"built into its graph ({where}), so a copy of it on {device.type} would compute "
            "another function", where=where)
    copies = copy.deepcopy(models, _straight_to(device, models))
    for model in copies:
        model.to(device)
    return copies


def _straight_to(device: torch.device, models: tuple[nn.Module, ...]) -> dict[int, Any]:
    """A deepcopy memo that copies every parameter and buffer of ``models`` straight to
    ``device``, once each: no second copy of the weights where they are."""
    memo: dict[int, Any] = {}
    for model in models:
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
        for b in model.buffers():
            if id(b) not in memo:
                memo[id(b)] = b.detach().to(device)
    return memo


def _guards_in(model: nn.Module) -> list[InputGuard]:
    """Every input guard held by ``model`` or a submodule."""
    return [value for owner in model.modules() for value in vars(owner).values()
            if isinstance(value, InputGuard)]
