"""Which tensors autograd saves for backward at each node, asked of autograd itself.

``saved_for_backward(gm, example_inputs)`` interprets the graph once on fake tensors (parameters
swapped for fake copies that require grad as the real ones do; see ``fxopt.graph.fake_run``) with
``torch.autograd.graph.saved_tensors_hooks`` active around each node's execution. Every tensor
autograd packs is matched by storage identity against the graph's values and the module's
parameters and buffers; what matches nothing is "internal" (BatchNorm's mean/invstd, the dropout
mask, max-pool indices) and counted in bytes. Leaf modules are seen like any other node, since
the hooks see every op they run.

The graph runs in train mode with grad enabled, as in ``fxopt.core.step.training_step`` (the module's
flags are restored), and follows the inputs' ``requires_grad`` and the parameters' as a real
training step would: a Linear whose input needs no grad does not keep its weight. Each call node gets ``node.meta["fxopt_saved"]``; the graph, the real
parameters, buffers, ``.grad`` and the RNG are untouched.

An opaque leaf reading tensor values replays its real run on the example inputs
(``fxopt.graph.leaf_tape``), so autograd is asked about it like any node. A node whose fake
execution still fails (such a leaf with no recorded run) falls back to a small hand table (``source="table"``): activations save their output, Linear/conv their input,
BatchNorm its input plus mean/invstd, dropout a mask, max-pool indices; anything else is assumed
to save its tensor inputs. Its output is rebuilt from ``meta["val"]``.

Not handled: tensors saved through ``ctx.foo = x`` in a custom autograd Function (not packed,
invisible to hooks). A checkpointed region (``fxopt.runtime.regions``) installs its own hooks
inside the node, so its node reports only what reaches ours: the region's inputs and, for a
selective region, the outputs it keeps (as internal bytes), which it saves for backward as
autograd saves any tensor.

The pack hooks here (and in ``fxopt.analysis.leaf_runs``, ``fxopt.planning.inplace``) keep and
give autograd ``t.detach()``, never ``t`` itself. Autograd holds each saved tensor's pack hook
and what it returned from C++ until the node is freed; were either ``t`` (a node saving its own
output) or a list of ``t``s closed over by the hook, the graph would hold itself through
references Python's garbage collector cannot see, and live as long as the process, with every
checkpointed region's frame in it: its RootState, the modules it read (the optimized module
itself once they are sharded with FSDP2) and its RNG state. A detached alias shares the
storage (what the analyses match by) and the version counter, so nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.autograd.graph import saved_tensors_hooks

from fxopt.graph.fake_run import FakeRun, fake_copy, on_fake_tensors, training_flags
from fxopt.core import meta_keys
from fxopt.core.errors import TraceError
from fxopt.core.tensors import storage_bytes, storage_key, tensors_in
from fxopt.core.torch_private import tree_map_only

CALL_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class SavedInfo:
    """What autograd keeps alive for one node's backward.

    ``values``: graph values whose storage is saved (the node itself, its inputs, or the node
    that owns the storage), in graph order. ``params``: qualified names of the parameters and
    buffers saved, also those used inside a ``call_module``. ``internal_bytes``: storage bytes of
    saved tensors that are no graph value and no parameter. ``source``: "autograd" or "table".
    """

    values: tuple[fx.Node, ...] = ()
    params: tuple[str, ...] = ()
    internal_bytes: int = 0
    source: str = "autograd"


class _Recorder(fx.Interpreter):
    """Runs the graph on fakes and records each call node's packed tensors."""

    def __init__(self, gm: fx.GraphModule, run: FakeRun):
        super().__init__(gm)
        self.mode = run.mode
        self.param_names: dict[int, list[str]] = {}
        for name, t in run.state.items():
            self.param_names.setdefault(storage_key(t), []).append(name)
        self.owner: dict[int, fx.Node] = {}
        self.storages: dict[fx.Node, set[int]] = {}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.kept: list[Any] = []  # keeps storages alive so their identities are never reused
        self.infos: dict[fx.Node, SavedInfo] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in CALL_OPS:
            result = super().run_node(n)
            self._own(n, result)
            return result
        packed: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()  # never ``t`` itself: see fxopt.analysis.saved's module doc
            packed.append(t)
            return t

        try:
            with saved_tensors_hooks(pack, lambda t: t):
                result = super().run_node(n)
        except Exception as error:  # any failure of fake execution: fall back to the table
            result = self._stand_in(n, error)
            self._own(n, result)
            self.infos[n] = _table_info(self.module, n)
            return result
        self._own(n, result)
        self.kept.append(packed)
        self.infos[n] = self._resolve(n, packed)
        return result

    def _own(self, n: fx.Node, result: Any) -> None:
        self.kept.append(result)
        keys = {storage_key(t) for t in tensors_in(result)}
        self.storages[n] = keys
        for key in keys:
            self.owner.setdefault(key, n)

    def _resolve(self, n: fx.Node, packed: list[torch.Tensor]) -> SavedInfo:
        values: set[fx.Node] = set()
        params: set[str] = set()
        internal: list[torch.Tensor] = []
        for t in packed:
            key = storage_key(t)
            candidates = [n, *n.all_input_nodes]
            node = next((c for c in candidates if key in self.storages.get(c, ())),
                        self.owner.get(key))
            if node is not None:
                values.add(node)
            if key in self.param_names:
                params.update(self.param_names[key])
            elif node is None:
                internal.append(t)
        return SavedInfo(tuple(sorted(values, key=self.order.__getitem__)),
                         tuple(sorted(params)), storage_bytes(internal))

    def _stand_in(self, n: fx.Node, error: Exception) -> Any:
        """Fake outputs shaped like ``meta["val"]``, requiring grad when the node would."""
        if "val" not in n.meta:
            raise TraceError(
                f"node {n.name} cannot run on fake tensors and has no meta['val'] to stand in: "
                f"{type(error).__name__}: {error}",
                where=f"node {n.name} ({n.op} {n.target})",
                hint="call fxopt.graph.meta.refresh_meta(gm) after editing the graph",
            ) from error
        inputs = tensors_in(self.fetch_args_kwargs_from_env(n))
        grad = any(t.requires_grad for t in inputs)
        if n.op == "call_module":
            grad = grad or any(p.requires_grad for p in self.fetch_attr(n.target).parameters())

        def rebuild(t: torch.Tensor) -> torch.Tensor:
            fresh = fake_copy(t, self.mode)
            return fresh.requires_grad_(grad and (t.is_floating_point() or t.is_complex()))

        return tree_map_only(torch.Tensor, rebuild, n.meta["val"])


def _value_bytes(node: Any) -> int:
    """``storage_bytes`` of a node's ``meta["val"]``; 0 for an argument that is no node."""
    return storage_bytes(node.meta.get("val")) if isinstance(node, fx.Node) else 0


def _table_info(gm: fx.GraphModule, n: fx.Node) -> SavedInfo:
    """Hand-table guess of what ``n`` saves, for a node autograd could not be asked about."""
    module = gm.get_submodule(n.target) if n.op == "call_module" else None
    name = type(module).__name__ if module is not None else getattr(n.target, "__name__", str(n.target))
    name = name.lower()
    first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    inputs = tuple(n.all_input_nodes)
    own = tuple(p for p, _ in module.named_parameters()) if module is not None else ()
    prefix = f"{n.target}." if module is not None else ""
    params = tuple(prefix + p for p in own)
    if any(k in name for k in ("relu", "sigmoid", "tanh", "elu", "softmax", "hardtanh")):
        return SavedInfo((n,), (), 0, "table")
    if "batchnorm" in name or "batch_norm" in name:
        channels = getattr(module, "num_features", 0)
        return SavedInfo(inputs[:1], params, 2 * channels * 4, "table")
    if "dropout" in name:
        return SavedInfo((), (), _value_bytes(first), "table")
    if "maxpool" in name or "max_pool" in name:
        val = n.meta.get("val")
        numel = val.numel() if isinstance(val, torch.Tensor) else 0
        return SavedInfo(inputs[:1], (), numel * 8, "table")
    if any(k in name for k in ("linear", "conv")):
        return SavedInfo(inputs[:1], params, 0, "table")
    tensor_inputs = tuple(i for i in inputs if _value_bytes(i))
    return SavedInfo(tensor_inputs, params, 0, "table")


def saved_for_backward(gm: fx.GraphModule, example_inputs: Any) -> dict[fx.Node, SavedInfo]:
    """call node -> SavedInfo; also stored as ``node.meta["fxopt_saved"]``."""
    with on_fake_tensors(gm, example_inputs) as run, training_flags(gm, True), torch.enable_grad():
        recorder = _Recorder(gm, run)
        recorder.run(*run.inputs)
    for node, info in recorder.infos.items():
        node.meta[meta_keys.SAVED] = info
    return recorder.infos

