"""The memory an opaque leaf takes, measured inside it on a real run and on its fake replay.

An opaque leaf that cannot run on fake tensors is recorded on a real run at capture
(``fxopt.capture.leaf_recording``) and replays that run in every fake-tensor analysis
(``fxopt.graph.leaf_tape``). ``record_leaf_memory(gm, example_inputs)`` measures, for each
such leaf, the figures a reader of a report wants to check: the peak of storage allocated inside
its forward (above what was live when it was called: temporaries, outputs and what it saves),
the bytes it saves for backward beyond its inputs, parameters and buffers, and its outputs'
bytes. It measures them twice -- on a real training forward on the example inputs (the
``measured`` figures) and on the fake replay the predictions run (``replayed``) -- and stores a
``LeafMemory`` on the leaf's record (``LeafRecord.memory``). Where the replay goes through, the
two agree to the byte on CPU (``LeafMemory.exact``), and the predicted peaks count the leaf op by
op; where it does not, the measured figures are what its stand-in allocates.

``leaf_lines(gm)`` says so in one line per leaf, for the report.

When it is safe: the real forward runs under ``preserved_state`` (no backward; BatchNorm
statistics, flags and the RNG restored). Cost: one training forward of the model, only when it
has recorded leaves.

Not handled: a leaf called several times per forward is described by its first call in train
mode; storage a kernel allocates without returning a tensor is not seen (as everywhere in
``fxopt.analysis.memtrack``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.graph import saved_tensors_hooks

from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.graph.fake_run import on_fake_tensors, training_flags
from fxopt.graph.leaf_tape import LeafRecord, forwards_patched, leaf_records, opaque_leaves
from fxopt.core import meta_keys
from fxopt.core.state import preserved_state
from fxopt.core.tensors import format_bytes, storage_bytes, storage_key, tensors_in


@dataclass(frozen=True)
class LeafFigures:
    """Bytes of one leaf call's forward: ``peak_bytes`` allocated inside it at most (above what
    was live at the call), ``saved_bytes`` saved for backward beyond its inputs, parameters and
    buffers, ``output_bytes`` of its outputs."""

    peak_bytes: int
    saved_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class LeafMemory:
    """A leaf's figures on the real run (``measured``) and on its fake replay (``replayed``;
    None where the replay does not go through)."""

    measured: LeafFigures
    replayed: LeafFigures | None

    @property
    def exact(self) -> bool:
        """Whether the fake replay the predictions run allocates what the real run did."""
        return self.replayed == self.measured

    @property
    def peak_bytes(self) -> int:
        return self.measured.peak_bytes

    @property
    def saved_bytes(self) -> int:
        return self.measured.saved_bytes


def _measuring(module: nn.Module, found: list[LeafFigures]) -> Callable[..., Any]:
    original = module.forward
    own = [*module.parameters(), *module.buffers()]

    def forward(*args: Any, **kwargs: Any) -> Any:
        kept = {storage_key(t) for t in [*tensors_in((args, kwargs)), *own]}
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()  # never ``t`` itself: see fxopt.analysis.saved's module doc
            packed.append(t)
            return t

        tracker = LiveStorageTracker()
        with saved_tensors_hooks(pack, lambda t: t), tracker:
            out = original(*args, **kwargs)
        saved = storage_bytes([t for t in packed if storage_key(t) not in kept])
        found.append(LeafFigures(tracker.peak_bytes, saved, storage_bytes(out)))
        return out

    return forward


def _figures(gm: fx.GraphModule, run: Callable[[], Any], leaves: list[nn.Module]
             ) -> dict[int, list[LeafFigures]]:
    found: dict[int, list[LeafFigures]] = {id(leaf): [] for leaf in leaves}
    with forwards_patched([(leaf, _measuring(leaf, found[id(leaf)])) for leaf in leaves]):
        run()
    return found


def _training_forward(gm: fx.GraphModule, inputs: tuple) -> None:
    with training_flags(gm, True), torch.enable_grad():
        gm(*inputs)


def record_leaf_memory(gm: fx.GraphModule, example_inputs: tuple) -> list[LeafRecord]:
    """Measure each recorded leaf of ``gm`` on a real training forward and on its fake replay
    (see the module doc); sets ``LeafRecord.memory`` and returns the records."""
    found = [(leaf, node.meta[meta_keys.LEAF]) for leaf, node in opaque_leaves(gm)
             if meta_keys.LEAF in node.meta]
    if not found:
        return []
    leaves = [leaf for leaf, _ in found]
    with preserved_state(gm):
        measured = _figures(gm, lambda: _training_forward(gm, example_inputs), leaves)
    replayed: dict[int, list[LeafFigures]] = {}
    if all(record.replays for _, record in found):
        try:
            with on_fake_tensors(gm, example_inputs) as fake:
                replayed = _figures(gm, lambda: _training_forward(gm, fake.inputs), leaves)
        except Exception:  # noqa: BLE001 -- no replayed figures; the measured ones stand
            replayed = {}
    for leaf, record in found:
        if measured[id(leaf)]:
            fakes = replayed.get(id(leaf)) or [None]
            record.memory = LeafMemory(measured[id(leaf)][0], fakes[0] if record.replays else None)
    return leaf_records(gm)


def leaf_lines(gm: nn.Module) -> list[str]:
    """One line per recorded leaf: what it took on the real run and how predictions count it."""
    lines = []
    for record in leaf_records(gm):
        memory = record.memory
        figures = (f"peak inside {format_bytes(memory.measured.peak_bytes)}, saves "
                   f"{format_bytes(memory.measured.saved_bytes)} for backward, outputs "
                   f"{format_bytes(memory.measured.output_bytes)}" if memory is not None
                   else "not measured")
        if record.replays and memory is not None and memory.exact:
            how = "predictions replay that run on fake tensors (same figures)"
        elif record.replays:
            how = "predictions replay that run on fake tensors"
        else:
            how = "its replay on fake tensors failed: predictions count these measured figures"
        lines.append(f"{record.path} ({record.module_type}), measured on a real run on the "
                     f"example inputs: {figures}; {how}")
    return lines


def measure_leaves(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """``record_leaf_memory``, and its lines on the capture's ``TraceInfo.leaf_runs`` (what the
    report prints under the leaves)."""
    if record_leaf_memory(gm, example_inputs):
        gm.meta[meta_keys.TRACE].leaf_runs = tuple(leaf_lines(gm))
