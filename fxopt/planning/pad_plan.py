"""Which heavy ops to pad, to what sizes, and where padded channels flow (analysis; no edits).

A *padded value* holds its real channels first and zeros after them along one dimension:
``Padded(dim, real, total)``, with ``dim`` counted from the end, so broadcasting and unbatched
inputs need no special case. The batch dimension is never padded.

Padded values start at *anchors*, the heavy ops whose channel or feature sizes are not multiples
of ``multiple``: Conv1d/2d/3d modules and ``F.conv*d`` (grouped and depthwise ones by adding
whole groups, so a padded channel never meets a real output channel), ConvTranspose modules and
``F.conv_transpose*d`` with groups=1, Linear and ``F.linear`` (in and out features), and
``matmul``/``mm``/``bmm``/``@`` (the inner dimension K and the outer N; never M). An anchor's
weight gets zero rows for padded outputs and zero columns for padded inputs, its bias zeros: the
padded outputs are exactly zero, and whatever sits in padded inputs meets zero weights.

Padding then flows through ops that keep a zero channel zero and never mix channels:
activations with f(0) = 0 (ReLU & co., GELU, SiLU, Hardswish, Mish, Tanh, ELU, Hardtanh around
0), pooling over spatial dims, BatchNorm (run on the padded tensor with zero weight and bias and
padded running statistics; see ``passes.pad_channels``), ``flatten`` that starts at the padded
dim (the zeros stay at the end), adds and subtractions of two values padded alike, products of
two such values or with a number, and division by a nonzero number. Every other consumer gets
the original shape back. Dropout is such a consumer on purpose: its random mask depends on the
tensor's shape, so a padded dropout would drop different elements than the original model.

What an unpadded consumer gets back is a view (``narrow``) of the real channels: not dense, with
the padded tensor's strides. Where that could change the result, the plan says to give the
consumer a dense copy laid out in memory as the original value was (``PadPlan.copies``):

- a random op (``fxopt.analysis.randomness``) reading the value or a view of it. Its result
  depends on the memory layout, not only on the values: on CUDA, ``native_dropout`` draws its mask
  in memory order with a vectorised kernel for a dense input and in a grid-stride order for any
  other, so the same seed drops different elements of a narrowed view than of the original dense
  tensor (the padded transformer_lm's wrong gradients on an H200, 2026-11-27). The CPU dropout
  draws in logical order and hid it. In-place random ops keep the view (their write must reach
  the padded value; torch draws their noise on ``empty_like``, in logical order for both);
- the graph's outputs, ``view``/``view_as`` and user modules, which may rely on the layout.

Not handled: ops inside opaque leaves, modules with hooks, subclasses of the listed modules,
convs with a padding_mode other than zeros, grouped ConvTranspose, 1-D matmul operands, and a
BatchNorm module the graph calls more than once (its padding stops there: the input is sliced).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.analysis.aliases import alias_classes
from fxopt.analysis.randomness import draws_random_numbers
from fxopt.analysis.writes import overwritten_inputs
from fxopt.core.modules import has_hooks
from fxopt.planning.pad_policy import TimingCase


@dataclass(frozen=True)
class Padded:
    """Along ``dim`` (negative), ``real`` channels then zeros up to ``total``."""

    dim: int
    real: int
    total: int


@dataclass(frozen=True)
class Resize:
    """Bring an operand to ``total`` entries along ``dim`` (its first ``real`` are real)."""

    dim: int
    real: int
    total: int


@dataclass(frozen=True)
class Operand:
    """A graph value or a ``get_attr`` target (a module's weight or bias); None: no bias."""

    source: fx.Node | str | None
    resizes: tuple[Resize, ...] = ()


@dataclass
class AnchorPlan:
    node: fx.Node
    op: str                       # a key of fxopt.planning.pad_policy.OPS
    operands: list[Operand]       # input, weight, bias (or a, b)
    options: tuple[Any, ...]      # positional arguments after the operands, padded groups included
    out: Padded | None
    case: TimingCase
    old: str
    new: str
    flops: int
    extra_flops: int


@dataclass
class NormPlan:
    """A BatchNorm module call that runs on its padded input."""

    node: fx.Node
    path: str
    padded: Padded
    tracks: bool                  # running statistics are used and updated
    affine: bool
    momentum: float
    eps: float


@dataclass
class PadPlan:
    anchors: dict[fx.Node, AnchorPlan] = field(default_factory=dict)
    norms: dict[fx.Node, NormPlan] = field(default_factory=dict)
    layout: dict[fx.Node, Padded] = field(default_factory=dict)
    takes_padded: dict[fx.Node, set[fx.Node]] = field(default_factory=dict)
    # consumer -> {input -> its original memory order, outermost dim first; () or the identity:
    # contiguous}: give the consumer a dense copy of the input laid out so
    copies: dict[fx.Node, dict[fx.Node, tuple[int, ...]]] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --- anchors ----------------------------------------------------------------------------------

@dataclass
class _Heavy:
    op: str
    x: fx.Node
    weight: fx.Node | str
    bias: fx.Node | str | None
    options: dict[str, Any]


_CONV_MODULES = {nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d",
                 nn.ConvTranspose1d: "conv_transpose1d", nn.ConvTranspose2d: "conv_transpose2d",
                 nn.ConvTranspose3d: "conv_transpose3d"}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONVT_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups",
               "dilation")
_FUNCTIONAL = {F.conv1d: ("conv1d", _CONV_ARGS), F.conv2d: ("conv2d", _CONV_ARGS),
               F.conv3d: ("conv3d", _CONV_ARGS),
               F.conv_transpose1d: ("conv_transpose1d", _CONVT_ARGS),
               F.conv_transpose2d: ("conv_transpose2d", _CONVT_ARGS),
               F.conv_transpose3d: ("conv_transpose3d", _CONVT_ARGS),
               F.linear: ("linear", ("input", "weight", "bias"))}
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1,
             "output_padding": 0}
_MATMUL_FUNCTIONS = {torch.matmul, operator.matmul, torch.mm, torch.bmm}
_MATMUL_METHODS = {"matmul", "mm", "bmm"}


def _heavy(gm: fx.GraphModule, node: fx.Node) -> _Heavy | None:
    """The node as a heavy op with its operands, or None."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if node.kwargs or len(node.args) != 1 or has_hooks(module):
            return None
        if type(module) is nn.Linear:
            bias = f"{node.target}.bias" if module.bias is not None else None
            return _Heavy("linear", node.args[0], f"{node.target}.weight", bias, {})
        op = _CONV_MODULES.get(type(module))
        if op is None or module.padding_mode != "zeros":
            return None
        options = {k: getattr(module, k) for k in ("stride", "padding", "dilation", "groups")}
        if op.startswith("conv_transpose"):
            options["output_padding"] = module.output_padding
        bias = f"{node.target}.bias" if module.bias is not None else None
        return _Heavy(op, node.args[0], f"{node.target}.weight", bias, options)
    if node.op == "call_function" and node.target in _FUNCTIONAL:
        op, names = _FUNCTIONAL[node.target]
        if len(node.args) > len(names) or set(node.kwargs) - set(names):
            return None
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        options = {k: bound.get(k, _DEFAULTS[k]) for k in names[3:]}
        if any(isinstance(v, fx.Node) for v in options.values()):
            return None
        return _Heavy(op, bound.get("input"), bound.get("weight"), bound.get("bias"), options)
    is_matmul = (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS)
    if is_matmul and len(node.args) == 2 and not node.kwargs:
        return _Heavy("matmul", node.args[0], node.args[1], None, {})
    return None


def _value(gm: fx.GraphModule, source: Any) -> torch.Tensor | None:
    """The tensor (its fake meta value, for graph values) an operand stands for."""
    if isinstance(source, str):
        owner, _, name = source.rpartition(".")
        value = getattr(gm.get_submodule(owner), name)
    else:
        value = source.meta.get("val") if isinstance(source, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _state(layout: dict[fx.Node, Padded], source: Any, dims: tuple[int, ...]) -> Padded | None:
    state = layout.get(source) if isinstance(source, fx.Node) else None
    return state if state is not None and state.dim in dims else None


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _resized(shape: tuple[int, ...], resizes: tuple[Resize, ...]) -> tuple[int, ...]:
    out = list(shape)
    for r in resizes:
        out[r.dim] = r.total
    return tuple(out)


def _fmt(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "x".join(map(str, shape))


def _plan_heavy(gm: fx.GraphModule, node: fx.Node, heavy: _Heavy,
                layout: dict[fx.Node, Padded], multiple: int) -> AnchorPlan | str | None:
    """How to pad one heavy op; None when it is aligned already, a reason when it cannot be."""
    x, w, out = _value(gm, heavy.x), _value(gm, heavy.weight), node.meta.get("val")
    if x is None or w is None or not isinstance(out, torch.Tensor) or \
            not x.is_floating_point() or not w.is_floating_point() or \
            (heavy.bias is not None and _value(gm, heavy.bias) is None):
        return None
    if heavy.op == "matmul":
        return _plan_matmul(gm, node, heavy, x, w, out, layout, multiple)
    transposed = heavy.op.startswith("conv_transpose")
    groups = heavy.options.get("groups", 1)
    if heavy.op == "linear":  # weight (out, in); features last
        channel, c_in, c_out = -1, w.shape[1], w.shape[0]
    else:  # weight (out, in / groups, *kernel), transposed (in, out / groups, *kernel)
        channel = -(w.dim() - 1)
        if x.dim() not in (-channel, 1 - channel):  # (batch,) channels, *spatial
            return None
        c_in = w.shape[0] if transposed else w.shape[1] * groups
        c_out = w.shape[1] * groups if transposed else w.shape[0]
    if transposed and groups != 1:
        aligned = c_in % multiple == 0 and c_out % multiple == 0
        return None if aligned else "grouped ConvTranspose is not padded"
    state = _state(layout, heavy.x, (channel,))
    new_groups = _padded_groups(c_in, c_out, groups, state, multiple) if groups > 1 else 1
    if groups > 1:
        x_total, out_total = new_groups * (c_in // groups), new_groups * (c_out // groups)
    else:
        x_total, out_total = state.total if state else round_up(c_in, multiple), \
            round_up(c_out, multiple)
    if x_total == c_in and out_total == c_out:
        return None
    rank = w.dim()
    x_resize = (Resize(channel, c_in, x_total),)
    outs, ins = Resize(-rank, c_out, out_total), Resize(-rank + 1, c_in, x_total)
    if transposed:  # weight (in, out / groups, *kernel)
        outs, ins = Resize(-rank + 1, c_out, out_total), Resize(-rank, c_in, x_total)
    w_resize = (outs,) if groups > 1 else (outs, ins)
    bias = Operand(heavy.bias, (Resize(-1, c_out, out_total),) if heavy.bias else ())
    names = (_CONVT_ARGS if transposed else _CONV_ARGS)[3:] if heavy.options else ()
    padded_options = {**heavy.options, "groups": new_groups}
    padded_out = _resized(_shape(out), (Resize(channel, c_out, out_total),))
    kernel = math.prod(w.shape[2:]) if heavy.op != "linear" else 1
    if transposed:
        flops = 2 * x.numel() * c_out * kernel
        new_flops = 2 * math.prod(_resized(_shape(x), x_resize)) * out_total * kernel
    else:
        flops = 2 * out.numel() * (c_in // groups) * kernel
        new_flops = 2 * math.prod(padded_out) * (x_total // new_groups) * kernel
    return _anchor(
        gm, node, heavy.op, [Operand(heavy.x, x_resize), Operand(heavy.weight, w_resize), bias],
        (tuple(heavy.options[k] for k in names), tuple(padded_options[k] for k in names)),
        Padded(channel, c_out, out_total) if out_total != c_out else None, layout,
        (_shape(out), padded_out), (flops, new_flops), (groups, new_groups))


def _padded_groups(c_in: int, c_out: int, groups: int, state: Padded | None,
                   multiple: int) -> int:
    """Groups of a grouped conv padded by whole groups (channels per group unchanged), so that
    its in and out channels are aligned; the input's padded size when that already fits."""
    per_in, per_out = c_in // groups, c_out // groups
    step = math.lcm(multiple // math.gcd(multiple, per_in), multiple // math.gcd(multiple, per_out))
    if state and state.total % per_in == 0 and (state.total // per_in) % step == 0:
        return state.total // per_in
    return round_up(groups, step)


def _plan_matmul(gm: fx.GraphModule, node: fx.Node, heavy: _Heavy, a: torch.Tensor,
                 b: torch.Tensor, out: torch.Tensor, layout: dict[fx.Node, Padded],
                 multiple: int) -> AnchorPlan | None:
    if a.dim() < 2 or b.dim() < 2:
        return None
    k, n = a.shape[-1], b.shape[-1]
    a_state = _state(layout, heavy.x, (-1,))
    b_k, b_n = _state(layout, heavy.weight, (-2,)), _state(layout, heavy.weight, (-1,))
    k_total = max([s.total for s in (a_state, b_k) if s] or [round_up(k, multiple)])
    n_total = b_n.total if b_n else round_up(n, multiple)
    if k_total == k and n_total == n:
        return None
    b_resize = tuple(r for r in (Resize(-2, k, k_total), Resize(-1, n, n_total))
                     if r.total != r.real)
    operands = [Operand(heavy.x, (Resize(-1, k, k_total),) if k_total != k else ()),
                Operand(heavy.weight, b_resize)]
    padded_out = _resized(_shape(out), (Resize(-1, n, n_total),))
    return _anchor(gm, node, "matmul", operands, ((), ()),
                   Padded(-1, n, n_total) if n_total != n else None, layout,
                   (_shape(out), padded_out),
                   (2 * out.numel() * k, 2 * math.prod(padded_out) * k_total), (1, 1))


def _anchor(gm: fx.GraphModule, node: fx.Node, op: str, operands: list[Operand],
            options: tuple[tuple, tuple], out: Padded | None, layout: dict[fx.Node, Padded],
            out_shapes: tuple[tuple[int, ...], tuple[int, ...]], flops: tuple[int, int],
            groups: tuple[int, int]) -> AnchorPlan:
    """The AnchorPlan, with its timing case and its report lines; pairs are (old, new)."""
    shapes, padded, copied = [], [], []
    for operand in operands:
        value = _value(gm, operand.source)
        shape = None if value is None else _shape(value)
        shapes.append(shape)
        padded.append(None if shape is None else _resized(shape, operand.resizes))
        state = layout.get(operand.source) if isinstance(operand.source, fx.Node) else None
        arrives = state is not None and len(operand.resizes) == 1 and \
            (state.dim, state.total) == (operand.resizes[0].dim, operand.resizes[0].total)
        copied.append(bool(operand.resizes) and not arrives)
    first = _value(gm, operands[0].source)
    case = TimingCase(op, tuple(shapes), tuple(padded), tuple(copied), options[0], options[1],
                      str(first.dtype), str(first.device))
    old, new = (f"{op} {' x '.join(_fmt(s) for s in operand_shapes if s)} -> {_fmt(result)}"
                + (f" (groups {g})" if groups != (1, 1) else "")
                for operand_shapes, result, g in zip((shapes, padded), out_shapes, groups))
    return AnchorPlan(node, op, operands, options[1], out, case, old, new, flops[0],
                      flops[1] - flops[0])


# --- propagation ------------------------------------------------------------------------------

_ZERO_KEEPING_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Hardswish,
                         nn.Mish, nn.Tanh, nn.ELU, nn.SELU, nn.CELU, nn.Softsign, nn.Identity,
                         nn.Hardtanh)
_ZERO_KEEPING_FUNCTIONS = {F.relu, F.relu_, torch.relu, torch.relu_, F.relu6, F.leaky_relu,
                           F.leaky_relu_, F.gelu, F.silu, F.hardswish, F.mish, torch.tanh,
                           F.tanh, F.elu, F.elu_, F.selu, torch.selu, torch.selu_, F.celu,
                           torch.celu, F.hardtanh, F.hardtanh_, F.softsign}
_ZERO_KEEPING_METHODS = {"relu", "relu_", "tanh", "tanh_", "contiguous", "clone"}
_POOL_MODULES = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1,
                 nn.AvgPool2d: 2, nn.AvgPool3d: 3, nn.AdaptiveAvgPool1d: 1,
                 nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3, nn.AdaptiveMaxPool1d: 1,
                 nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3}
_POOL_FUNCTIONS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.avg_pool1d: 1,
                   F.avg_pool2d: 2, F.avg_pool3d: 3, F.adaptive_avg_pool1d: 1,
                   F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
                   F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3}
_ADDS = {operator.add, operator.sub, operator.iadd, operator.isub, torch.add, torch.sub,
         "add", "add_", "sub", "sub_"}
_MULS = {operator.mul, operator.imul, torch.mul, "mul", "mul_"}
_DIVS = {operator.truediv, operator.itruediv, torch.div, "div", "div_"}
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _target(gm: fx.GraphModule, node: fx.Node) -> Any:
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    return node.target if node.op in ("call_function", "call_method") else None


def _propagated(gm: fx.GraphModule, node: fx.Node, layout: dict[fx.Node, Padded]
                ) -> Padded | None:
    """The padded layout of ``node``'s result when it may take its padded inputs as they are."""
    out = node.meta.get("val")
    first = node.args[0] if node.args else None
    state = layout.get(first) if isinstance(first, fx.Node) else None
    if not isinstance(out, torch.Tensor) or (node.op == "call_module" and node.kwargs):
        return None
    target = _target(gm, node)
    if isinstance(target, nn.Module) and has_hooks(target):
        return None
    if state is not None and out.dim() == first.meta["val"].dim():
        others = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, fx.Node)]
        if not others and _keeps_zero(target, node):
            return state
        spatial = _POOL_MODULES.get(type(target)) if isinstance(target, nn.Module) else \
            _POOL_FUNCTIONS.get(target) if node.op == "call_function" else None
        if not others and spatial is not None and state.dim == -(spatial + 1):
            return state
    if state is not None and (type(target) is nn.Flatten or target in (torch.flatten, "flatten")):
        return _flattened(node, target, state, first.meta["val"].dim())
    if node.op in ("call_function", "call_method") and len(node.args) == 2:
        return _binary(node, layout)
    return None


def _keeps_zero(target: Any, node: fx.Node) -> bool:
    if isinstance(target, nn.Module):
        if type(target) not in _ZERO_KEEPING_MODULES:
            return False
        return type(target) is not nn.Hardtanh or target.min_val <= 0 <= target.max_val
    if node.op == "call_method":
        return target in _ZERO_KEEPING_METHODS
    if target in (F.hardtanh, F.hardtanh_):
        bound = dict(zip(("min_val", "max_val"), node.args[1:])) | dict(node.kwargs)
        low, high = bound.get("min_val", -1.0), bound.get("max_val", 1.0)
        return isinstance(low, (int, float)) and isinstance(high, (int, float)) and \
            low <= 0 <= high
    return target in _ZERO_KEEPING_FUNCTIONS


def _flattened(node: fx.Node, target: Any, state: Padded, rank: int) -> Padded | None:
    if isinstance(target, nn.Module):
        start, end = target.start_dim, target.end_dim
    else:
        names = ("start_dim", "end_dim")
        bound = dict(zip(names, node.args[1:])) | dict(node.kwargs)
        start, end = bound.get("start_dim", 0), bound.get("end_dim", -1)
    start, end, padded = start % rank, end % rank, state.dim + rank
    out_rank = rank - (end - start)
    if padded < start:
        return Padded(padded - out_rank, state.real, state.total)
    if padded == start and end == rank - 1:
        rest = math.prod(node.args[0].meta["val"].shape[start + 1:])
        return Padded(-1, state.real * rest, state.total * rest)
    return None


def _binary(node: fx.Node, layout: dict[fx.Node, Padded]) -> Padded | None:
    lhs, rhs = node.args
    states = [layout.get(a) if isinstance(a, fx.Node) else None for a in (lhs, rhs)]
    target = node.target
    kwargs_ok = not node.kwargs or (target in _ADDS and set(node.kwargs) == {"alpha"}
                                    and not isinstance(node.kwargs["alpha"], fx.Node))
    if not kwargs_ok:
        return None
    both = states[0] is not None and states[0] == states[1] and \
        lhs.meta["val"].shape == rhs.meta["val"].shape
    if target in _ADDS or target in _MULS:
        if both:
            return states[0]
    number = (int, float)
    if target in _MULS:
        if states[0] is not None and isinstance(rhs, number):
            return states[0]
        if states[1] is not None and isinstance(lhs, number) and target != "mul_":
            return states[1]
    if target in _DIVS and states[0] is not None and isinstance(rhs, number) and rhs != 0:
        return states[0]
    return None


def _used_elsewhere(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether another node reaches ``node``'s module: the padded call writes its statistics back
    with ``copy_``, which would invalidate a running_mean another call saved for backward."""
    prefix = f"{node.target}."
    return any(other is not node and other.op in ("call_module", "get_attr") and
               (other.target == node.target or other.target.startswith(prefix))
               for other in gm.graph.nodes)


def _norm_plan(gm: fx.GraphModule, node: fx.Node, layout: dict[fx.Node, Padded]
               ) -> NormPlan | None:
    if node.op != "call_module" or node.kwargs or len(node.args) != 1:
        return None
    module = gm.get_submodule(node.target)
    x = node.args[0]
    state = layout.get(x) if isinstance(x, fx.Node) else None
    if type(module) not in _BATCH_NORMS or has_hooks(module) or state is None or \
            module.momentum is None or state.dim + x.meta["val"].dim() != 1 or \
            _used_elsewhere(gm, node):
        return None
    stats = (module.running_mean, module.running_var, module.num_batches_tracked)
    if module.track_running_stats and all(s is not None for s in stats):
        tracks = True
    elif not module.track_running_stats and module.running_mean is None and \
            module.running_var is None:
        tracks = False
    else:
        return None
    return NormPlan(node, node.target, state, tracks, module.affine, module.momentum, module.eps)


# --- the plan ---------------------------------------------------------------------------------

def plan_padding(gm: fx.GraphModule, *, multiple: int,
                 keep: Callable[[TimingCase], bool | str]) -> PadPlan:
    """Walk ``gm`` in order: pad each anchor that ``keep`` accepts (True; False or a reason
    declines it), and follow the padding."""
    plan = PadPlan()
    for node in gm.graph.nodes:
        heavy = _heavy(gm, node)
        if heavy is not None:
            anchor = _plan_heavy(gm, node, heavy, plan.layout, multiple)
            verdict = keep(anchor.case) if isinstance(anchor, AnchorPlan) else None
            if isinstance(anchor, str):
                plan.declined[node.name] = anchor
            elif anchor is not None and verdict is not True:
                plan.declined[node.name] = verdict or "measured: not faster padded"
            elif anchor is not None:
                plan.anchors[node] = anchor
                plan.takes_padded[node] = {o.source for o in anchor.operands
                                           if isinstance(o.source, fx.Node)}
                if anchor.out is not None:
                    plan.layout[node] = anchor.out
            continue
        norm = _norm_plan(gm, node, plan.layout)
        if norm is not None:
            plan.norms[node] = norm
            plan.layout[node] = norm.padded
            plan.takes_padded[node] = {node.args[0]}
            continue
        state = _propagated(gm, node, plan.layout)
        if state is not None:
            plan.layout[node] = state
            plan.takes_padded[node] = {a for a in node.all_input_nodes if a in plan.layout}
    if plan.layout:
        plan.copies = _layout_copies(gm, plan)
    return plan


# --- consumers that get a dense copy in the original layout ----------------------------------

def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s dims from outermost to innermost in memory when ``t`` is dense (no gaps, no
    overlaps), else None. Contiguous: ``(0, 1, ..., n-1)``; channels_last: ``(0, 2, 3, 1)``."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    for memory_format, order in ((torch.channels_last, (0, 2, 3, 1)),
                                 (torch.channels_last_3d, (0, 2, 3, 4, 1))):
        if t.dim() == len(order) and t.is_contiguous(memory_format=memory_format):
            return order
    sizes, strides = tuple(t.shape), tuple(t.stride())
    if not all(isinstance(v, int) for v in (*sizes, *strides)):  # symbolic: cannot tell
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order


def _relies_on_layout(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` may rely on its input's layout: outputs, ``view``, user modules."""
    if node.op == "output" or (node.op == "call_method" and node.target in ("view", "view_as")):
        return True
    if node.op == "call_module":
        return not type(gm.get_submodule(node.target)).__module__.startswith("torch.")
    return False


def _layout_copies(gm: fx.GraphModule, plan: PadPlan) -> dict[fx.Node, dict[fx.Node, tuple]]:
    """The unpadded consumers that must get a dense copy of an input in its original layout
    (see the module docstring), from the original graph's fake values."""
    classes = alias_classes(gm)
    padded = {classes[v] for v in plan.layout if v in classes}
    copies: dict[fx.Node, dict[fx.Node, tuple[int, ...]]] = {}
    for node in gm.graph.nodes:
        if node in plan.layout or node in plan.anchors:
            continue  # takes its inputs padded
        if node.op != "output" and draws_random_numbers(gm, node):
            written = overwritten_inputs(gm, node)
            wanted = [v for v in node.all_input_nodes
                      if classes.get(v) in padded and v not in written]
        elif _relies_on_layout(gm, node):
            wanted = [v for v in node.all_input_nodes if v in plan.layout]
        else:
            continue
        for value in wanted:
            val = value.meta.get("val")
            order = memory_order(val) if isinstance(val, torch.Tensor) else None
            if order is None and value in plan.layout:
                order = ()  # a padded value was made dense; its order unknown: contiguous
            if order is not None:  # an input that was not dense: CUDA reads it in logical order
                copies.setdefault(node, {})[value] = order
    return copies
