"""CPU tests that catch tensors made on the wrong device: ``default_device_elsewhere()``.

fxopt must take the device of every tensor it makes from the graph, the module or the inputs
(DESIGN.md, "The device and the training step"). A tensor made without naming a device lands on
the *default* device, which is the CPU on a CPU test machine, so on CPU such a bug is invisible:
the tensor happens to be where the model is. Inside ``default_device_elsewhere()`` the default
device is ``meta``: a tensor fxopt makes without naming a device is a meta tensor, and the first
op that mixes it with the model's CPU tensors raises (or copying data out of it does), as a CPU
tensor mixed with a CUDA model does on a GPU.

Build the model and its inputs *before* entering (they are the user's, on the CPU), and run
fxopt's own work inside. ``graphs_of(module)`` lists every graph an optimized module runs (root,
eval-mode graph, kept blocks, checkpointed region bodies, scoped bodies) and
``baked_devices(module)`` the ``torch.device`` literals left in them, for tests that check the
capture device was not built in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx, nn

from fxopt.capture.export_devices import literal_devices
from fxopt.graph.graphs import graphs_of as all_graphs

ELSEWHERE = "meta"


@contextlib.contextmanager
def default_device_elsewhere(device: str = ELSEWHERE) -> Iterator[None]:
    """Inside: tensors made without a device go to ``device`` (``meta``), not the CPU."""
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        # None, not "cpu", when nothing was set: setting "cpu" leaves a device mode on the
        # torch-function stack, which slows every later op and turns off torch's fast paths
        torch.set_default_device(None if previous == torch.device("cpu") else previous)


def graphs_of(module: nn.Module) -> list[tuple[str, fx.Graph]]:
    """(where, graph) for every graph ``module`` runs (``fxopt.graph.graphs.graphs_of``: each
    GraphModule's own graph and its eval-mode graph, the bodies of its checkpointed regions and
    the scoped bodies it holds as plain attributes, nested ones included)."""
    return [(of.where, of.graph) for of in all_graphs(module)]


def baked_devices(module: nn.Module, device: torch.device | str = "cpu") -> list[str]:
    """``where: node`` for every node of ``module``'s graphs with ``device`` as a literal."""
    device = torch.device(device)
    return [f"{where}: {node.format_node()}" for where, graph in graphs_of(module)
            for node, found in literal_devices(graph) if found == device]
