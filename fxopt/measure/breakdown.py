"""Where the memory of a training step goes: what ``fxopt report`` prints.

``memory_breakdown(model, example_inputs)`` combines two figures:

- measured (``fxopt.measure.measure_train_step``): the peak of one training step split into
  parameters, buffers, inputs, parameter gradients and activations live at the peak;
- asked of autograd (``fxopt.analysis.saved_for_backward`` on fake tensors): every tensor saved
  for backward, with the layer that computed it and the layers whose backward keeps it, largest
  first. Tensors autograd saves that are no graph value (BatchNorm's mean and inverse std, dropout
  masks, max-pool indices) are listed as "internal" of the layer that saved them;
- when the user fused an optimizer's step into backward (``fused_optimizer=``): the peak
  predicted with that step (gradients, the step's temporaries and activations at it) and the
  optimizer's state. The measured figure runs with the fused step paused: fxopt's runs never
  update the user's parameters.

A layer is named by its module path and class (``layer1.0.conv1 (Conv2d)``); a function call
at the model's own level by its node and the source line that made it (``relu:
x = F.relu(self.conv1(x))``). Parameters saved for backward are not listed: they are counted
as parameters (in an ATen-level graph, which reads them with ``get_attr``, as in a module-level
one). A module fxopt captured or optimized is broken down on its own graph, not traced again.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import fx, nn

from fxopt.analysis import saved_for_backward
from fxopt.analysis.estimate import PeakEstimate, estimate_peak
from fxopt.core.graphs import placeholder_values
from fxopt.capture.trace import trace
from fxopt.core import meta_keys
from fxopt.core.tensors import storage_bytes, tensors_in
from fxopt.measure.advice import user_source_line
from fxopt.measure.peaks import MemoryFigure, format_bytes, measure_train_step, refuse_compiled
from fxopt.runtime.fused_step import FusedOptimizers, fused_parameters


@dataclass(frozen=True)
class SavedTensor:
    value: str                 # graph value name, or "(internal)"
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    produced_by: str           # the layer that computed it ("input" for a model input)
    kept_for: tuple[str, ...]  # the layers whose backward keeps it


@dataclass
class Breakdown:
    model: str
    train: MemoryFigure
    saved: list[SavedTensor] = field(default_factory=list)   # largest first, all of them
    saved_bytes: int = 0                                      # each storage counted once
    fused: PeakEstimate | None = None  # predicted with the user's fused optimizer step

    def as_dict(self, top: int | None = None) -> dict[str, Any]:
        return {"model": self.model, "train": self.train.as_dict(),
                "saved_bytes": self.saved_bytes,
                "saved": [asdict(s) for s in self.saved[:top]],
                "fused_step_predicted": None if self.fused is None else asdict(self.fused)}

    def format(self, top: int = 8) -> str:
        f = self.train
        lines = [f"memory of one training step of {self.model} (measured on {f.device}: "
                 f"{f.method})",
                 f"  peak                       {format_bytes(f.peak_bytes):>10}"]
        for label, value in (("parameters", f.params_bytes), ("buffers", f.buffers_bytes),
                             ("inputs", f.inputs_bytes),
                             ("gradients at the peak", f.grads_at_peak_bytes),
                             ("activations at the peak", f.activations_at_peak_bytes)):
            lines.append(f"    {label:<25}{format_bytes(value):>10}")
        if self.fused is not None:
            e = self.fused
            lines.append(f"  with the optimizer step fused into backward ({e.fused_parameters} "
                         "parameters; measured above with it paused), predicted on fake tensors:")
            lines.append(f"  peak                       {format_bytes(e.train_bytes):>10}")
            for label, value in (("params, buffers, inputs", e.baseline_bytes),
                                 ("gradients at the peak", e.train_grad_bytes),
                                 ("step's temporaries", e.train_optimizer_step_bytes),
                                 ("activations at the peak", e.activation_bytes)):
                lines.append(f"    {label:<25}{format_bytes(value):>10}")
            lines.append(f"  optimizer state (alive throughout, not in the peaks) "
                         f"{format_bytes(e.optimizer_state_bytes)}")
        lines.append(f"  saved for backward: {format_bytes(self.saved_bytes)} in "
                     f"{len(self.saved)} tensors; the largest:")
        for s in self.saved[:top]:
            shape = "x".join(map(str, s.shape)) if s.shape else ""
            lines.append(f"    {format_bytes(s.nbytes):>10}  {s.value:<14} {shape:<16} "
                         f"{s.dtype:<8} made by {s.produced_by}; kept for "
                         f"{', '.join(s.kept_for)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def layer_of(gm: fx.GraphModule, node: fx.Node, *, detailed: bool = True) -> str:
    """The layer that owns ``node``: its module path (and class), or its node name (and source
    line)."""
    if node.op == "placeholder":
        return "input"
    if node.op == "call_module":
        kind = f" ({type(gm.get_submodule(node.target)).__name__})" if detailed else ""
        return f"{node.target}{kind}"
    stack = meta_keys.module_stack(node)
    if stack:
        path, kind = stack[-1]
        return f"{path} ({meta_keys.kind_name(kind)})" if detailed else path
    line = user_source_line(node) if detailed else ""
    return f"{node.name}: {line}" if line else node.name


def _size_shape_dtype(value: Any) -> tuple[int, tuple[int, ...], str]:
    """``storage_bytes`` of ``value``, and the shape and dtype of its first tensor."""
    tensors = tensors_in(value)
    if not tensors:
        return 0, (), ""
    first = tensors[0]
    return storage_bytes(tensors), tuple(first.shape), str(first.dtype).removeprefix("torch.")


def _captured(model: nn.Module) -> bool:
    """Whether ``model`` is a graph with fake values on its placeholders (fxopt's output)."""
    return isinstance(model, fx.GraphModule) and all(
        "val" in node.meta for node in model.graph.find_nodes(op="placeholder"))


def saved_tensors(gm: fx.GraphModule) -> tuple[list[SavedTensor], int]:
    """Every tensor saved for backward in ``gm`` (largest first) and their unique bytes."""
    infos = saved_for_backward(gm, placeholder_values(gm))
    kept: dict[fx.Node, list[str]] = {}
    internal: list[SavedTensor] = []
    for node, info in infos.items():
        for value in info.values:
            kept.setdefault(value, []).append(layer_of(gm, node, detailed=False))
        if info.internal_bytes:
            internal.append(SavedTensor("(internal)", (), "", info.internal_bytes,
                                        layer_of(gm, node), (layer_of(gm, node, detailed=False),)))
    state = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    saved = []
    for value, users in kept.items():
        if value.op == "get_attr" and id(_attribute(gm, value.target)) in state:
            continue  # a parameter or buffer an ATen-level graph reads: counted as such
        nbytes, shape, dtype = _size_shape_dtype(value.meta.get("val"))
        saved.append(SavedTensor(value.name, shape, dtype, nbytes, layer_of(gm, value),
                                 tuple(dict.fromkeys(users))))
    everything = sorted(saved + internal, key=lambda s: -s.nbytes)
    return everything, sum(s.nbytes for s in everything)


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None


def memory_breakdown(model: nn.Module, example_inputs: Any, *,
                     gm: fx.GraphModule | None = None,
                     fused_optimizer: FusedOptimizers = None) -> Breakdown:
    """Measured peak split by kind, and the tensors saved for backward (see the docstring).
    ``gm``: ``model``'s graph, when already captured; a module fxopt captured or optimized
    (an ``fx.GraphModule`` with values on its placeholders) is its own graph.
    ``fused_optimizer``: the user's optimizer step fused into backward (``fxopt.fuse_optimizer``).
    A module running torch.compile'd code is refused (``InputError``): its saved tensors are the
    compiler's choice, not the graph's."""
    refuse_compiled("memory_breakdown", model)
    if gm is None and _captured(model):
        gm = model
    traced = gm if gm is not None else trace(model, example_inputs)
    saved, saved_bytes = saved_tensors(traced)
    fused = (estimate_peak(traced, placeholder_values(traced), fused_optimizer=fused_optimizer)
             if fused_parameters(model, fused_optimizer) else None)
    return Breakdown(type(model).__name__, measure_train_step(model, example_inputs), saved,
                     saved_bytes, fused)
