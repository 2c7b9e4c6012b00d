"""The memory model fxopt's passes take their decisions from: pure functions, no graph edits.

- ``last_use(gm)``: where FX's generated code drops each value (``fxopt.analysis.aliases``).
- ``alias_classes(gm)``: which values share a storage, from the fake tensors' storage identity.
- ``saved_for_backward(gm, inputs)``: what autograd saves per node, asked of autograd itself on
  fake tensors (``fxopt.analysis.saved``); annotates ``node.meta["fxopt_saved"]``.
- ``estimate_peak(module, inputs)``: predicted training and inference peaks from a fake-tensor
  run under the same live-storage tracker the CPU measurement uses (``fxopt.analysis.estimate``).
- ``max_batch_size(model, inputs, budget_bytes)``: the largest batch whose predicted training
  peak fits a budget.

None of them runs real compute, mutates the graph, or touches the real parameters, buffers,
``.grad`` or the RNG; only ``saved_for_backward`` writes ``node.meta`` (one key).
"""

from fxopt.analysis.aliases import alias_classes, last_use
from fxopt.analysis.estimate import PeakEstimate, estimate_peak, max_batch_size
from fxopt.analysis.saved import SavedInfo, saved_for_backward

__all__ = [
    "PeakEstimate",
    "SavedInfo",
    "alias_classes",
    "estimate_peak",
    "last_use",
    "max_batch_size",
    "saved_for_backward",
]
