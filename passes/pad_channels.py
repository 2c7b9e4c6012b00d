"""Pad channel and feature sizes to multiples of ``multiple`` so heavy kernels run aligned.

``pad_channels(gm)`` rewrites the heavy ops that ``fxopt.planning.pad_plan`` picks (convs, including
grouped and depthwise ones, ConvTranspose, Linear, functional conv/linear, matmul) into their
functional form on padded operands, lets the padding flow through channel-wise ops, and gives
every other consumer the original shape back. See ``fxopt.planning.pad_plan`` for which ops pad and
which carry padding, and ``fxopt.planning.pad_policy`` for when padding is worth it.

When it is safe: on every graph it rewrites, except the cases under "Not handled" below, the
padded model computes the same function as the original -- the same values in exact arithmetic,
and the same random numbers drawn for the same elements on CPU and CUDA. Padding flows only
through the ops ``fxopt.planning.pad_plan`` lists; every other op gets the original shape. How:

- Parameters stay the user's, with their shapes: weights and biases are padded *inside the
  graph* (``F.pad`` of the parameter), so gradients reach the real Parameter through the pad,
  and the padded region of a parameter never exists as state (it cannot drift in training).
- Padded weight rows, columns and biases are zero (``F.pad`` writes exact zeros in every dtype),
  so padded outputs are exactly zero and padded inputs meet zero weights: a padded channel never
  leaks into a real one, forward or backward.
- BatchNorm on a padded tensor runs ``F.batch_norm`` with zero-padded weight and bias and
  running statistics padded for the call (mean 0, variance 1, so padded channels stay 0 in
  eval too); the updated real statistics are copied back into the module's buffers and
  ``num_batches_tracked`` is incremented exactly when the module would (its ``training`` flag is
  read at run time). Checkpointed regions recompute on copies of these buffers like any other.
- The value handed to an unpadded consumer is a view (``narrow``) of the real channels. Where
  the consumer's result may depend on the layout, it gets a dense copy laid out in memory as the
  original value was: random ops (dropout and the others ``fxopt.analysis.randomness`` lists)
  reading the value or a view of it, the model's outputs, ``view``, user modules. A random op
  must: CUDA's dropout draws its mask in memory order, with another kernel for a non-dense input,
  so a narrowed view would drop other elements than the original tensor under the same seed.
  That was the forced pad of transformer_lm failing verification on an H200 in float16 and
  bfloat16 (gradients 10-100x off) while every CPU run verified: the CPU dropout draws in logical
  order whatever the strides. It was never a half-precision bug.

Equal up to rounding, not bit for bit: padded ops run other kernels (other tile shapes and
summation orders), so results differ at rounding level, which is larger in float16/bfloat16;
``fxopt.verify`` compares with per-dtype tolerances.

Checked on CPU in float32, float16 and bfloat16, with CUDA's dropout emulated
(``tests/test_pad_channels.py``); re-check on a GPU with ``benchmarks/pad_channels.py --device
cuda``.

Policy (``fxopt.planning.pad_policy``): by default the pass changes nothing unless the graph runs
on CUDA in float16/bfloat16, or in float32 with TF32 on for its convs (cuDNN, torch's default) or
its matmuls; there it pads only the ops that run on tensor cores, and keeps a pad only where
timing says the padded op is faster. ``force=True`` pads every op it can (e.g. on CPU, for
tests, or under autocast); ``tensor_cores`` decides for given TF32 switches instead of torch's.

Padding is for speed and costs memory: padded activations are larger (odd_channel_cnn's
training peak grows about 15%). Stats: ``padded_ops``; ``extra_flops`` and ``extra_flops_pct``;
``slices`` (values handed back unpadded); ``ops``, one entry per padded op with its old and new
operand -> output shapes and extra FLOPs; ``declined`` (op -> why not); ``timings_ms``.

Not handled: BatchNorm with ``momentum=None`` (its input is sliced back: it runs unpadded),
ops inside opaque leaves, modules with hooks, and the limits listed in ``fxopt.planning.pad_plan``.
Optimizing a padded module again traces its ``getattr(bn, "training")`` as a constant: right
for the train and eval graphs, wrong for a BatchNorm frozen in eval inside a training model.
Random ops whose CUDA kernel depends on more than the memory order may still differ: a dropout
reading a view at an offset into a padded value (its dense copy starts aligned, the original
view may not, and the kernel's vector width follows the alignment). In-place random ops keep the
narrowed view, so that their write reaches the padded value (torch draws their noise on
``empty_like`` of the input, in logical order for the view and the original alike; not yet
checked on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from fxopt.analysis.writes import overwritten_by_a_user
from fxopt.core import meta_keys
from fxopt.core.errors import ConfigError
from fxopt.planning.pad_plan import (
    AnchorPlan,
    NormPlan,
    Operand,
    Padded,
    PadPlan,
    Resize,
    plan_padding,
)
from fxopt.planning.pad_policy import (
    OPS,
    TensorCores,
    Timer,
    TimingCase,
    default_decider,
    pad_list,
    padding_pays,
)
from fxopt.rewrite.pass_base import PassResult, StatsItem, graph_edited, mark_new

PASS_NAME = "pad_channels"
MULTIPLES = (8, 16, 32, 64)


@dataclass(frozen=True)
class PaddedOp(StatsItem):
    """One padded heavy op, in the pass's ``stats["ops"]``: its shapes before and after."""

    node: str
    old: str
    new: str
    extra_flops: int

    def line(self) -> str:
        return f"{self.node:<18} {self.old}  =>  {self.new}  (+{self.extra_flops:,} FLOPs)"


def pad_channels(gm: fx.GraphModule, *, multiple: int = 8, force: bool = False,
                 measure: bool | None = None, timer: Timer | None = None,
                 tensor_cores: TensorCores | None = None) -> PassResult:
    """Pad unaligned channel/feature sizes of heavy ops (see the module docstring).

    ``multiple``: 8, 16, 32 or 64. ``force``: pad whatever the device and dtype. ``measure``:
    time each padded op against the original and keep only faster pads (default: on CUDA when
    not forced). ``timer``: replaces the timing function (``(case) -> (original_s, padded_s)``).
    ``tensor_cores``: the TF32 switches the policy decides for (default: torch's, as set now).
    """
    if isinstance(multiple, bool) or multiple not in MULTIPLES:
        raise ConfigError(f"pad_channels: multiple={multiple!r} is not supported",
                          where="pass pad_channels",
                          hint=f"use one of {', '.join(map(str, MULTIPLES))}")
    if not force:
        pays, reason = padding_pays(gm, tensor_cores)
        if not pays:
            return PassResult(gm, False, {"reason": reason})
    decider = default_decider(gm, measure=measure, timer=timer, force=force, cores=tensor_cores)
    plan = plan_padding(gm, multiple=multiple, keep=decider.keep)
    stats: dict[str, Any] = {"multiple": multiple, "padded_ops": len(plan.anchors)}
    if decider.timings:
        stats["timings_ms"] = {_describe(case): f"{a * 1e3:.3f} -> {b * 1e3:.3f}"
                               for case, (a, b) in decider.timings.items()}
    if plan.declined:
        stats["declined"] = dict(plan.declined)
    if not plan.anchors:
        stats["reason"] = "every heavy op is aligned already" if not plan.declined else \
            "no heavy op could be padded or was worth it (see declined)"
        return PassResult(gm, False, stats)
    slices = _Rewriter(gm, plan).run()
    graph_edited(gm)
    flops = sum(a.flops for a in plan.anchors.values())
    extra = sum(a.extra_flops for a in plan.anchors.values())
    stats.update({"extra_flops": extra,
                  "extra_flops_pct": round(100.0 * extra / flops, 2) if flops else 0.0,
                  "slices": slices,
                  "ops": [PaddedOp(a.node.name, a.old, a.new, a.extra_flops)
                          for a in plan.anchors.values()]})
    return PassResult(gm, True, stats)


def _describe(case: TimingCase) -> str:
    shapes = " x ".join("x".join(map(str, shape)) for shape in case.shapes if shape)
    return f"{case.op} {shapes}"


class _Rewriter:
    """Applies a PadPlan to its graph, node by node, in graph order."""

    def __init__(self, gm: fx.GraphModule, plan: PadPlan):
        self.gm, self.graph, self.plan = gm, gm.graph, plan
        self.origin: dict[fx.Node, fx.Node] = {}     # replacement node -> the node it replaced
        self.current: dict[fx.Node, fx.Node] = {}    # replaced node -> its replacement
        self.attrs: dict[str, fx.Node] = {}
        self.narrowed: dict[fx.Node, fx.Node] = {}
        self.resized: dict[tuple[fx.Node, tuple[Resize, ...]], fx.Node] = {}
        self.slices = 0
        self.like: fx.Node | None = None

    def run(self) -> int:
        for node in list(self.graph.nodes):
            self.like = node
            with self.graph.inserting_before(node):
                if node in self.plan.anchors:
                    self._replace(node, self._anchor(self.plan.anchors[node]))
                elif node in self.plan.norms:
                    self._replace(node, self._batch_norm(node, self.plan.norms[node]))
                else:
                    self._unpad_inputs(node)
        return self.slices

    def _replace(self, old: fx.Node, new: fx.Node) -> None:
        old.replace_all_uses_with(new)
        self.origin[new] = old
        self.current[old] = new
        self.graph.erase_node(old)

    def _new(self, op: str, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs or {})
        if self.like is not None:  # where in the user's model the new node comes from
            node.meta.update({k: v for k, v in self.like.meta.items()
                              if k in ("stack_trace", meta_keys.NN_MODULE_STACK)})
        return mark_new(node, PASS_NAME)

    def _call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self._new("call_function", target, args, kwargs)

    def _attr(self, target: str) -> fx.Node:
        if target not in self.attrs:
            self.attrs[target] = self._new("get_attr", target, ())
        return self.attrs[target]

    def _state(self, value: fx.Node) -> Padded | None:
        return self.plan.layout.get(self.origin.get(value, value))

    # --- consumers that need the original shape ------------------------------------------

    def _unpad_inputs(self, node: fx.Node) -> None:
        takes = self.plan.takes_padded.get(node, set())
        copies = self.plan.copies.get(node, {})
        for value in node.all_input_nodes:
            original = self.origin.get(value, value)
            state = self._state(value)
            if original in takes or (state is None and original not in copies):
                continue
            real = value if state is None else self._narrow(value, state)
            if original in copies:
                real = self._dense_copy(real, copies[original])
            node.replace_input_with(value, real)

    def _dense_copy(self, value: fx.Node, order: tuple[int, ...]) -> fx.Node:
        """A dense copy of ``value`` whose memory order is ``order`` (outermost dim first)."""
        rank = len(order)
        formats = {(0, 2, 3, 1): torch.channels_last, (0, 2, 3, 4, 1): torch.channels_last_3d}
        if order == tuple(range(rank)):
            return self._new("call_method", "contiguous", (value,))
        if order in formats:
            return self._new("call_method", "contiguous", (value,),
                             {"memory_format": formats[order]})
        inverse = tuple(sorted(range(rank), key=order.__getitem__))
        permuted = self._new("call_method", "permute", (value, *order))
        dense = self._new("call_method", "contiguous", (permuted,))
        return self._new("call_method", "permute", (dense, *inverse))

    def _narrow(self, value: fx.Node, state: Padded) -> fx.Node:
        if value not in self.narrowed:
            self.narrowed[value] = self._call(torch.narrow, value, state.dim, 0, state.real)
            self.slices += 1
        return self.narrowed[value]

    # --- anchors -------------------------------------------------------------------------

    def _anchor(self, plan: AnchorPlan) -> fx.Node:
        operands = [self._operand(o) for o in plan.operands]
        return self._call(OPS[plan.op], *operands, *plan.options)

    def _operand(self, operand: Operand) -> fx.Node | None:
        if operand.source is None:
            return None
        source = operand.source
        value = self._attr(source) if isinstance(source, str) else self.current.get(source, source)
        key = (value, operand.resizes)
        if key in self.resized and not overwritten_by_a_user(self.gm, value):
            return self.resized[key]
        state = self._state(value) if value.op != "get_attr" else None
        current, grow = value, {}
        wanted = {r.dim for r in operand.resizes}
        if state is not None and state.dim not in wanted:
            current, state = self._narrow(value, state), None
        for r in operand.resizes:
            have = state.total if state is not None and state.dim == r.dim else r.real
            if r.total < have:
                current = self._call(torch.narrow, current, r.dim, 0, r.total)
            elif r.total > have:
                grow[r.dim] = r.total - have
        if grow:
            current = self._call(F.pad, current, pad_list(grow))
        self.resized[key] = current
        return current

    # --- BatchNorm on padded channels ------------------------------------------------------

    def _batch_norm(self, node: fx.Node, plan: NormPlan) -> fx.Node:
        x = node.args[0]
        extra = [0, plan.padded.total - plan.padded.real]
        weight = bias = None
        if plan.affine:
            weight = self._call(F.pad, self._attr(f"{plan.path}.weight"), extra)
            bias = self._call(F.pad, self._attr(f"{plan.path}.bias"), extra)
        if not plan.tracks:
            return self._call(F.batch_norm, x, None, None, weight, bias, True, plan.momentum,
                              plan.eps)
        training = self._call(getattr, self._attr(plan.path), "training")
        mean, var = self._attr(f"{plan.path}.running_mean"), self._attr(f"{plan.path}.running_var")
        padded_mean = self._call(F.pad, mean, extra)
        padded_var = self._call(F.pad, var, extra, value=1.0)
        self._new("call_method", "add_", (self._attr(f"{plan.path}.num_batches_tracked"),
                                          training))
        out = self._call(F.batch_norm, x, padded_mean, padded_var, weight, bias, training,
                         plan.momentum, plan.eps)
        for buffer, padded in ((mean, padded_mean), (var, padded_var)):
            real = self._call(torch.narrow, padded, 0, 0, plan.padded.real)
            self._new("call_method", "copy_", (buffer, real))
        return out
