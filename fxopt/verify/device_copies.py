"""Copies of the models on another device, for a proof that cannot run on theirs.

``fxopt.verify.fitting`` proves a rewrite on CPU copies of both models where the original's
training step does not fit the device even at batch 1, where the model's code fixes the batch,
or where the module was captured with ``dynamic=False``. ``copies_on(device, *models)`` makes
them: deep copies whose parameters and buffers are copied straight to ``device``, once each
(what the models share stays shared), so the models' own device never holds a second copy of
the weights.

An export-captured module's input guard refuses a module moved to another device type
(``fxopt.runtime.input_guard``), since its graph may have the capture's device type built in.
A copy's guard moves with the copy when no graph in it names a device type other than
``device``'s (``fxopt.capture.export_devices.device_types_built_in``): torch.export's device
literals follow the module (``follow_devices``), so what can still name one is an autocast
scope, or a literal that no parameter, buffer or input was on at capture. When one does,
``copies_on`` raises ``InputError`` saying what and where, and copies nothing.

Not handled: an operator that has a kernel on one device type only raises when the copy runs
it, as the original's copy would. The user's own ``.to()`` of an export-captured module to
another device type stays refused: only these copies, made for a proof, are moved.
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
    """Deep copies of ``models`` on ``device`` (what they share stays shared), their input
    guards moved with them; ``InputError`` where a guarded graph has another device type built
    in (the module doc)."""
    for model in models:
        named = [(kind, where) for kind, where in device_types_built_in(model)
                 if kind != device.type]
        if named and _guards_in(model):
            kind, where = named[0]
            raise InputError(
                f"{type(model).__name__} was captured by torch.export with the device type "
                f"{kind!r} built into its graph ({where}), so a copy of it on {device.type} "
                "would compute another function", where=where)
    copies = copy.deepcopy(models, _straight_to(device, models))
    for model in copies:
        model.to(device)
        for owner, name, guard in _guards_in(model):
            setattr(owner, name, guard.on_device_type(device.type))
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


def _guards_in(model: nn.Module) -> list[tuple[nn.Module, str, InputGuard]]:
    """Every input guard held by ``model`` or a submodule, with its owner and attribute."""
    return [(owner, name, value) for owner in model.modules()
            for name, value in vars(owner).items() if isinstance(value, InputGuard)]
