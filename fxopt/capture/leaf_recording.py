"""Run a captured model's opaque leaves for real on the example inputs, and record what they did.

``record_leaf_runs(gm, example_inputs)`` is called by capture after shape propagation. For the
leaves that could not run on fake tensors (``meta["fxopt_meta_source"] == "real"``) it runs the
whole captured module for real twice on the example inputs -- a training forward (train mode,
grad enabled) and an inference forward (eval mode, no grad) -- and records each call of each such
leaf (``fxopt.graph.leaf_tape.LeafCall``: every op's outputs, the leaf's outputs, the inputs
it wrote in place). The record goes on every node that calls the leaf
(``node.meta["fxopt_leaf"]``), shapes are propagated again with the leaves replaying their
records, and one fake training step and one fake inference forward check that the replay goes
through; where it does not, the leaves fall back to their recorded stand-ins
(``LeafRecord.replays = False``).

When it is safe: the real runs happen under ``preserved_state`` (BatchNorm statistics, ``.grad``,
flags and the RNG are restored) and never call backward. They cost one training forward's memory
(the activations autograd keeps) and time, only for models with such leaves. With fake example
inputs (a graph re-captured from its placeholders) nothing is recorded.

Not handled: a model that does not run for real on the example inputs (its leaves keep the
outputs of a run on random inputs, as before).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from fxopt.graph.fake_run import on_fake_tensors, training_flags
from fxopt.graph.leaf_tape import (
    META_KEY,
    LeafRecord,
    forwards_patched,
    leaf_records,
    nodes_calling,
    opaque_leaves,
    recorded_call,
)
from fxopt.graph.meta import propagate_meta
from fxopt.core import meta_keys
from fxopt.core.state import preserved_state
from fxopt.core.step import training_step
from fxopt.core.tensors import tensors_in
from fxopt.core.torch_private import FakeTensor


def _recording(module: nn.Module, record: LeafRecord) -> Any:
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out, call = recorded_call(module, original, args, kwargs)
        record.calls.append(call)
        return out

    return forward


def _real_runs(gm: fx.GraphModule, args: tuple, records: dict[int, LeafRecord],
               leaves: list[nn.Module]) -> None:
    patches = [(leaf, _recording(leaf, records[id(leaf)])) for leaf in leaves]
    with forwards_patched(patches):
        # each run from the user's state: the training forward updates BatchNorm statistics,
        # which the inference forward must not see
        with preserved_state(gm), training_flags(gm, True), torch.enable_grad():
            gm(*args)
        with preserved_state(gm), training_flags(gm, False), torch.no_grad():
            gm(*args)


def replay_checked(gm: fx.GraphModule, args: tuple) -> bool:
    """Whether one fake training step and one fake inference forward of ``gm`` go through with
    its leaves replaying their records."""
    try:
        with on_fake_tensors(gm, args) as run:
            with training_flags(gm, True), torch.enable_grad():
                training_step(gm, run.inputs)
            with training_flags(gm, False), torch.no_grad():
                gm(*run.inputs)
    except Exception:  # noqa: BLE001 -- any failure on fakes: use the recorded stand-ins
        return False
    return True


def record_leaf_runs(gm: fx.GraphModule, args: tuple) -> list[LeafRecord]:
    """Record the real runs of ``gm``'s leaves that cannot run on fakes (see the module doc);
    returns their records (empty when there are none or ``args`` are fake)."""
    found = opaque_leaves(gm)
    if not found or any(isinstance(t, FakeTensor) for t in tensors_in(args)):
        return []
    records = {id(leaf): LeafRecord(node.target, type(leaf).__name__) for leaf, node in found}
    leaves = [leaf for leaf, _ in found]
    try:
        _real_runs(gm, args, records, leaves)
    except Exception:  # noqa: BLE001 -- the model does not run for real: keep what there is
        return []
    for leaf in leaves:
        records[id(leaf)].replays = True
        for node in nodes_calling(gm, leaf):
            node.meta[META_KEY] = records[id(leaf)]
            node.meta[meta_keys.META_SOURCE] = meta_keys.REAL
    propagate_meta(gm, args)
    if not replay_checked(gm, args):
        for record in records.values():
            record.replays = False
        propagate_meta(gm, args)
    return leaf_records(gm)
