"""The device a captured graph's factory ops make their tensors on, read when the graph runs.

torch.export records the device a tensor was made on as a literal: ``torch.ones(T, T,
device=x.device)`` becomes ``aten.ones.default([T, T], device=cpu)`` (or ``cuda:0``), and
``_assert_tensor_metadata`` and ``aten.to`` nodes name the capture device too. A module captured
on ``cuda:0`` and then moved to ``cuda:1`` would make those tensors on ``cuda:0``.
``fxopt.capture.export_devices`` replaces each such literal by a ``tensor_device(t)`` node, ``t``
a parameter, buffer or input that was on that device when the model was captured, so the
graph makes its tensors where that tensor is when it runs, as the model's own code did
(``x.device``). ``on_device(t, device)`` moves a tensor constant the capture lifted out of
forward (``torch.tensor([...], device=x.device)``) to that device when the graph runs: no copy
when it is there already. ``autocast_dtype(device_type)``: what autocast computes in on a device
type, for the runtime's own autograd functions to replay.

Imports torch and the standard library only, like all of ``fxopt.runtime`` (``fxopt.export``
copies this file next to the generated code).
"""

from __future__ import annotations

import torch


def tensor_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` is on when the graph runs."""
    return t.device


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: ``t`` itself when it is there (the usual case), else a copy."""
    return t.to(device)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type``, or None where it is off, or where
    autocast knows no such device type (``meta``: torch's query raises there)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None
