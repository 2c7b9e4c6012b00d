"""``--device`` and ``--threads``: where the CLI runs the model, and the CPU threads torch uses.

``parse_device("cuda:1")`` checks the text (``cpu``, ``cuda`` or ``cuda:N``) and that the device
exists in this process, raising an ``InputError`` (exit 2) that says what is missing and what to
do. ``to_device(model, inputs, device)`` moves the model (in place: the CLI built it) and every
tensor in the inputs, nested ones included. Once there, fxopt follows the tensors: memory is read
from the CUDA caching allocator and steps are synchronized when timed (``fxopt.measure``).

Not handled: other accelerators (mps, xpu), a model split over several devices.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from fxopt.core.errors import InputError
from fxopt.core.torch_private import tree_map_only

_DEVICE = re.compile(r"^(cpu|cuda(?::\d+)?)$")


def parse_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a ``torch.device`` that exists here, else InputError."""
    if not _DEVICE.match(text):
        raise InputError(f"unknown --device {text!r}", where="--device",
                         hint="use cpu (the default), cuda, or cuda:N for the N-th GPU")
    device = torch.device(text)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        build = (f"this torch is built for CUDA {torch.version.cuda} but finds no GPU"
                 if torch.version.cuda else "this torch is a CPU-only build")
        raise InputError(f"--device {text}: no CUDA device is available ({build})",
                         where="--device",
                         hint="run on a machine with an NVIDIA GPU and its driver (nvidia-smi "
                              "lists it; CUDA_VISIBLE_DEVICES must not hide it), or use "
                              "--device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise InputError(f"--device {text}: there is no GPU {device.index}; this machine has "
                         f"{count} (cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})",
                         where="--device", hint="pick one of those, or --device cuda")
    return device


def to_device(model: nn.Module, inputs: tuple, device: torch.device) -> tuple[nn.Module, tuple]:
    """The model and the inputs (every tensor, nested ones too) on ``device``."""
    return model.to(device), tree_map_only(torch.Tensor, lambda t: t.to(device), inputs)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside, the previous count restored after (so an
    in-process ``main()`` leaves its caller's setting alone); None changes nothing."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

