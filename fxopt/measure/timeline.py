"""Memory over the op timeline of one training step: what ``fxopt report`` plots.

``training_timeline(module, example_inputs)`` runs one training step (``fxopt.core.step``: forward,
then backward from deterministic cotangents, grads starting as None) under
``LiveStorageTracker(record_timeline=True)`` and returns the live tensor bytes after every aten
op -- forward, autograd's backward ops, recomputation of checkpointed regions -- on top of the
baseline of parameters, buffers and inputs. It is the same tracker and the same step as
``fxopt.measure`` on CPU, so the timeline's peak is the measured CPU training peak. Like
``measure`` it leaves grads, buffers, training flags and the RNG as they were.

On CUDA the figures are live storage bytes too (not the caching allocator's), so the curve has
the same meaning on both devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.core.state import preserved_state
from fxopt.core.step import as_args, backward_from
from fxopt.core.tensors import storage_bytes
from fxopt.measure.peaks import refuse_compiled


@dataclass(frozen=True)
class Timeline:
    label: str
    ops: tuple[str, ...]          # aten op names, in execution order
    live_bytes: tuple[int, ...]   # live tensor bytes after each op, baseline included
    baseline_bytes: int           # parameters + buffers + inputs
    backward_start: int           # index of the first op that ran in backward

    @property
    def peak_index(self) -> int:
        return max(range(len(self.live_bytes)), key=self.live_bytes.__getitem__) \
            if self.live_bytes else 0

    @property
    def peak_bytes(self) -> int:
        return self.live_bytes[self.peak_index] if self.live_bytes else self.baseline_bytes

    @property
    def peak_op(self) -> str:
        return self.ops[self.peak_index] if self.ops else ""

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "baseline_bytes": self.baseline_bytes,
                "backward_start": self.backward_start, "peak_bytes": self.peak_bytes,
                "peak_index": self.peak_index, "peak_op": self.peak_op,
                "ops": list(self.ops), "live_bytes": list(self.live_bytes)}


def training_timeline(module: nn.Module, example_inputs: Any, *, label: str = "") -> Timeline:
    """Live bytes after every op of one training step of ``module`` (see the module docstring).
    A module running torch.compile'd code is refused (``InputError``)."""
    refuse_compiled("training_timeline", module)
    inputs = as_args(example_inputs)
    baseline = storage_bytes((list(module.parameters()), list(module.buffers()), inputs))
    tracker = LiveStorageTracker(record_timeline=True)
    with preserved_state(module):
        for p in module.parameters():
            p.grad = None
        module.train()
        with tracker:
            output = module(*inputs)
            backward_start = len(tracker.timeline)
            backward_from(output)
            del output
    ops, live = zip(*tracker.timeline) if tracker.timeline else ((), ())
    return Timeline(label or type(module).__name__, tuple(ops),
                    tuple(baseline + b for b in live), baseline, backward_start)
