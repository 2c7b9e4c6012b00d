"""Random models for property-based tests: ``net_specs()`` draws a small DAG network.

A ``NetSpec`` is plain data (so hypothesis can shrink it and print it as a reproducer): the
input, a list of ``Op``s each reading earlier values by index, and which values are returned in
which container. ``build(spec)`` turns it into ``(RandomNet, example_inputs)``, deterministically
(weights and inputs come from ``spec.seed``; the global RNG is untouched).

What the networks contain: conv (odd widths, strides, groups, with and without bias), BatchNorm
1d/2d, LayerNorm, Linear, Embedding, activations as modules, functionals, tensor methods and
in-place modules, Dropout/Dropout2d/``F.dropout(x, p, self.training)``, max/avg/adaptive
pooling, add/mul of two branches, channel concatenation, view round trips, flatten, scaling by
a parameter, and a module called at a second call site. Branches are random: any op may read any
earlier live value, and dead ends are allowed. Every network drawn is valid by construction: it
runs forward and backward in train and eval mode on its inputs (an in-place activation only
consumes a value nobody else reads, so autograd never sees a modified saved tensor).

Importable from tests (``from random_models import net_specs, build``) and from benchmarks
(after putting ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

IMAGE, VECTOR = "image", "vector"
ACTIVATIONS = ("relu", "relu6", "leaky_relu", "silu", "gelu", "hardswish", "elu", "sigmoid",
               "tanh", "mish", "hardtanh")
INPLACE_ACTIVATIONS = ("relu", "relu6", "leaky_relu", "silu", "hardswish", "elu", "hardtanh")
ACT_MODULES = {"relu": nn.ReLU, "relu6": nn.ReLU6, "leaky_relu": nn.LeakyReLU, "silu": nn.SiLU,
               "gelu": nn.GELU, "hardswish": nn.Hardswish, "elu": nn.ELU, "sigmoid": nn.Sigmoid,
               "tanh": nn.Tanh, "mish": nn.Mish, "hardtanh": nn.Hardtanh}
# image ops of activation-heavy networks (no pooling or flattening: the activations stay large)
HEAVY_KINDS = ["conv"] * 4 + ["bn"] * 2 + ["act"] * 3 + ["dropout", "add", "scale", "reuse"]
# ops whose backward does not need their own output, so an in-place op may overwrite it
_OVERWRITABLE = {"conv", "linear", "bn", "layernorm", "add", "cat"}


@dataclass(frozen=True)
class Op:
    kind: str
    inputs: tuple[int, ...]
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


@dataclass(frozen=True)
class NetSpec:
    input_kind: str                 # "image" (N,C,H,W), "vector" (N,F) or "tokens" (N,L) int64
    input_shape: tuple[int, ...]
    ops: tuple[Op, ...]
    outputs: tuple[int, ...]        # value indices; value 0 is the input, value i+1 is ops[i]
    output_form: str                # "tensor" | "tuple" | "list" | "dict"
    seed: int


@dataclass
class _Value:
    kind: str
    shape: tuple[int, ...]          # without the batch dimension
    producer: str
    readers: int = 0
    alive: bool = True


def _same_shape(values: list[_Value], v: int) -> list[int]:
    return [i for i, x in enumerate(values)
            if i != v and x.alive and x.kind == values[v].kind and x.shape == values[v].shape]


@st.composite
def _op(draw: Any, values: list[_Value], chain: bool, heavy: bool = False
        ) -> tuple[Op, _Value] | None:
    """One op reading live values; None when the drawn kind does not fit them.

    ``chain``: read the newest value (conv -> bn -> act, with add/cat partners from anywhere);
    otherwise mostly the newest, sometimes a branch from any earlier value.
    """
    alive = [i for i, v in enumerate(values) if v.alive and v.kind != "tokens"]
    v = alive[-1] if chain else draw(st.sampled_from([alive[-1], alive[-1], *alive]))
    x = values[v]
    width = st.integers(1, 12)
    if x.kind == IMAGE:
        c, h, w = x.shape
        kind = draw(st.sampled_from(HEAVY_KINDS if heavy else [
            "conv", "conv", "conv", "bn", "bn", "act", "act", "act", "dropout", "pool", "add",
            "add", "mul", "cat", "view", "flatten", "scale", "reuse"]))
    else:
        (c,) = x.shape
        kind = draw(st.sampled_from(["linear", "linear", "bn", "layernorm", "act", "act",
                                     "dropout", "add", "mul", "cat", "view", "scale", "reuse"]))
    if kind == "conv":
        k, stride = draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 1, 2]))
        out = draw(width)
        groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0 and out % g == 0]))
        opts = (("out", out), ("k", k), ("stride", stride), ("groups", groups),
                ("bias", draw(st.booleans())))
        shape = (out, (h - 1) // stride + 1, (w - 1) // stride + 1)  # padding k // 2
        return Op(kind, (v,), opts), _Value(IMAGE, shape, kind)
    if kind == "linear":
        out = draw(st.integers(1, 24))
        return Op(kind, (v,), (("out", out), ("bias", draw(st.booleans())))), _Value(
            VECTOR, (out,), kind)
    if kind == "bn":
        opts = (("affine", draw(st.booleans())), ("momentum", draw(st.sampled_from([0.1, 0.5]))))
        return Op(kind, (v,), opts), _Value(x.kind, x.shape, kind)
    if kind == "layernorm":
        return Op(kind, (v,), (("affine", draw(st.booleans())),)), _Value(VECTOR, x.shape, kind)
    if kind == "act":
        name = draw(st.sampled_from(("relu", "relu", *ACTIVATIONS)))
        forms = ["module", "functional", "method"]
        if name in INPLACE_ACTIVATIONS and x.producer in _OVERWRITABLE and x.readers == 0 and v:
            forms.append("inplace_module")
        form = draw(st.sampled_from(forms))
        if form == "inplace_module":
            x.alive = False  # its value is overwritten: nobody may read it afterwards
        return Op(kind, (v,), (("name", name), ("form", form))), _Value(x.kind, x.shape, kind)
    if kind == "dropout":
        forms = ["module", "functional"] + (["module2d"] if x.kind == IMAGE else [])
        opts = (("p", draw(st.sampled_from([0.1, 0.5]))), ("form", draw(st.sampled_from(forms))))
        return Op(kind, (v,), opts), _Value(x.kind, x.shape, kind)
    if kind == "pool":
        styles = ["adaptive"] + (["max", "avg"] if h >= 2 and w >= 2 else [])
        style = draw(st.sampled_from(styles))
        size = draw(st.sampled_from([1, 2])) if style == "adaptive" else 2
        shape = (c, size, size) if style == "adaptive" else (c, h // 2, w // 2)
        return Op(kind, (v,), (("style", style), ("size", size))), _Value(IMAGE, shape, kind)
    if kind in ("add", "mul"):
        partners = _same_shape(values, v)
        if not partners:
            return None
        u = draw(st.sampled_from(partners))
        values[u].readers += 1
        return Op(kind, (v, u)), _Value(x.kind, x.shape, kind)
    if kind == "cat":
        partners = [i for i, y in enumerate(values) if y.alive and y.kind == x.kind
                    and y.shape[1:] == x.shape[1:]]
        u = draw(st.sampled_from(partners))  # may be v itself: torch.cat([x, x])
        values[u].readers += 1
        return Op(kind, (v, u)), _Value(x.kind, (x.shape[0] + values[u].shape[0], *x.shape[1:]),
                                         kind)
    if kind == "view":
        return Op(kind, (v,)), _Value(x.kind, x.shape, kind)
    if kind == "flatten":
        style = draw(st.sampled_from(["flatten", "view"]))
        return Op(kind, (v,), (("style", style), ("features", c * h * w))), _Value(
            VECTOR, (c * h * w,), kind)
    if kind == "scale":
        return Op(kind, (v,)), _Value(x.kind, x.shape, kind)
    # "reuse": call a module of an earlier op again, where it maps this shape to itself
    return None


@st.composite
def _reuse(draw: Any, values: list[_Value], ops: list[Op]) -> tuple[Op, _Value] | None:
    """A second call site of an earlier op's module (conv/linear/bn/act module)."""
    candidates = []
    for j, op in enumerate(ops):
        source = values[op.inputs[0]]
        out = values[j + 1]
        is_module_call = op.kind in ("conv", "linear", "bn") or (
            op.kind == "act" and op.option("form") == "module")
        if is_module_call:
            if source.shape == out.shape and source.kind == out.kind:
                readers = [i for i, x in enumerate(values) if x.alive and x.kind == source.kind
                           and x.shape == source.shape]
                candidates += [(j, i) for i in readers]
    if not candidates:
        return None
    j, v = draw(st.sampled_from(candidates))
    values[v].readers += 1
    x = values[v]
    return Op("reuse", (v,), (("of", j),)), _Value(x.kind, x.shape, ops[j].kind)


@st.composite
def net_specs(draw: Any, max_ops: int = 10, min_ops: int = 1,
              input_kinds: tuple[str, ...] = (IMAGE, IMAGE, VECTOR, "tokens"),
              chain: bool | None = None, min_size: int = 1, heavy: bool = False) -> NetSpec:
    """A random valid network (see the module docstring).

    ``chain=True`` draws deep chains (each op reads the newest value), ``min_size`` the
    smallest image height, ``heavy=True`` only conv/bn/act/dropout/add/scale image ops; with
    ``min_ops`` they make activation-heavy networks, where checkpointing has something to save.
    """
    input_kind = draw(st.sampled_from(input_kinds))
    batch = draw(st.integers(2, 3))
    if input_kind == IMAGE:
        c, h = draw(st.integers(1, 6)), draw(st.integers(min_size, 20))
        w = draw(st.integers(max(4, min_size), 20))
        input_shape, values = (batch, c, h, w), [_Value(IMAGE, (c, h, w), "input")]
    elif input_kind == VECTOR:
        f = draw(st.integers(1, 16))
        input_shape, values = (batch, f), [_Value(VECTOR, (f,), "input")]
    else:
        length = draw(st.integers(1, 5))
        input_shape, values = (batch, length), [_Value("tokens", (length,), "input")]
    ops: list[Op] = []
    if input_kind == "tokens":
        dim = draw(st.integers(1, 12))
        ops.append(Op("embed_mean", (0,), (("vocab", 11), ("dim", dim))))
        values[0].readers += 1
        values.append(_Value(VECTOR, (dim,), "embed_mean"))
    chain = draw(st.booleans()) if chain is None else chain
    for _ in range(draw(st.integers(min_ops, max_ops))):
        values_before = len(values)
        drawn = draw(_op(values, chain, heavy))
        if drawn is None:
            drawn = draw(_reuse(values, ops))
        if drawn is None:
            continue
        op, value = drawn
        values[op.inputs[0]].readers += 1
        ops.append(op)
        values.append(value)
        assert len(values) == values_before + 1
    alive = [i for i, v in enumerate(values) if v.alive and v.kind != "tokens"]
    if not alive:
        # everything was consumed in place or only the token input is left: read the last op
        ops.append(Op("view", (len(values) - 1,)))
        values.append(_Value(values[-1].kind, values[-1].shape, "view"))
        alive = [len(values) - 1]
    last = alive[-1]
    extra = [] if chain else draw(st.lists(st.sampled_from(alive), max_size=2, unique=True))
    outputs = tuple(dict.fromkeys([last, *extra]))
    form = "tensor" if len(outputs) == 1 and draw(st.booleans()) else draw(
        st.sampled_from(["tuple", "list", "dict"]))
    return NetSpec(input_kind, input_shape, tuple(ops), outputs, form,
                   draw(st.integers(0, 2**16)))


class RandomNet(nn.Module):
    """The network a NetSpec describes (modules are attributes ``op<i>``)."""

    def __init__(self, spec: NetSpec):
        super().__init__()
        self.spec = spec
        kinds = [spec.input_kind if spec.input_kind != "tokens" else "tokens"]
        channels = [spec.input_shape[1] if spec.input_kind in (IMAGE, VECTOR) else None]
        for i, op in enumerate(spec.ops):
            c_in = channels[op.inputs[0]]
            module, c_out = self._module(op, c_in, kinds[op.inputs[0]],
                                         channels[op.inputs[1]] if len(op.inputs) > 1 else None)
            if module is not None:
                setattr(self, f"op{i}", module)
            if op.kind == "scale":
                shape = (c_in, 1, 1) if kinds[op.inputs[0]] == IMAGE else (c_in,)
                self.register_parameter(f"op{i}_scale", nn.Parameter(torch.rand(shape) + 0.5))
            if op.kind == "reuse":
                c_out = c_in
            kinds.append(VECTOR if op.kind in ("flatten", "linear", "embed_mean")
                         else kinds[op.inputs[0]])
            channels.append(c_out)

    @staticmethod
    def _module(op: Op, c: int | None, kind: str, c_other: int | None) -> tuple[Any, int | None]:
        o = op.option
        if op.kind == "conv":
            k = o("k")
            return nn.Conv2d(c, o("out"), k, o("stride"), k // 2, groups=o("groups"),
                             bias=o("bias")), o("out")
        if op.kind == "linear":
            return nn.Linear(c, o("out"), bias=o("bias")), o("out")
        if op.kind == "bn":
            cls = nn.BatchNorm2d if kind == IMAGE else nn.BatchNorm1d
            return cls(c, affine=o("affine"), momentum=o("momentum")), c
        if op.kind == "layernorm":
            return nn.LayerNorm(c, elementwise_affine=o("affine")), c
        if op.kind == "act" and o("form") in ("module", "inplace_module"):
            cls = ACT_MODULES[o("name")]
            return (cls(inplace=True) if o("form") == "inplace_module" else cls()), c
        if op.kind == "dropout" and o("form") != "functional":
            return (nn.Dropout2d if o("form") == "module2d" else nn.Dropout)(o("p")), c
        if op.kind == "embed_mean":
            return nn.Embedding(o("vocab"), o("dim")), o("dim")
        if op.kind == "cat":
            return None, c + c_other
        if op.kind == "flatten":
            return None, o("features")
        return None, c

    def forward(self, x):
        values = [x]
        for i, op in enumerate(self.spec.ops):
            values.append(self._compute(i, op, [values[j] for j in op.inputs]))
        outs = [values[j] for j in self.spec.outputs]
        form = self.spec.output_form
        if form == "tensor":
            return outs[0]
        if form == "dict":
            return {f"out{j}": v for j, v in zip(self.spec.outputs, outs)}
        return tuple(outs) if form == "tuple" else list(outs)

    def _compute(self, i: int, op: Op, xs: list[torch.Tensor]) -> torch.Tensor:
        kind, o, x = op.kind, op.option, xs[0]
        module = getattr(self, f"op{i}", None)
        if kind in ("conv", "linear", "bn", "layernorm", "embed_mean"):
            y = module(x)
            return y.mean(1) if kind == "embed_mean" else y
        if kind == "act":
            if o("form") in ("module", "inplace_module"):
                return module(x)
            name = o("name")
            if o("form") == "method" and hasattr(torch.Tensor, name):
                return getattr(x, name)()
            return getattr(torch if name in ("sigmoid", "tanh") else F, name)(x)
        if kind == "dropout":
            return F.dropout(x, o("p"), self.training) if module is None else module(x)
        if kind == "pool":
            if o("style") == "adaptive":
                return F.adaptive_avg_pool2d(x, o("size"))
            return (F.max_pool2d if o("style") == "max" else F.avg_pool2d)(x, 2)
        if kind == "add":
            return x + xs[1]
        if kind == "mul":
            return x * xs[1]
        if kind == "cat":
            return torch.cat([x, xs[1]], dim=1)
        if kind == "view":
            n = x.size(0)
            return x.reshape(n, -1).view(x.shape) * 1.0
        if kind == "flatten":
            return torch.flatten(x, 1) if o("style") == "flatten" else x.view(x.size(0), -1)
        if kind == "scale":
            return x * getattr(self, f"op{i}_scale")
        if kind == "reuse":
            return getattr(self, f"op{o('of')}")(x)
        raise AssertionError(f"unknown op {kind}")


def build(spec: NetSpec) -> tuple[RandomNet, tuple[torch.Tensor]]:
    """The network and its example inputs, the same for the same spec; global RNG untouched."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = RandomNet(spec)
    gen = torch.Generator().manual_seed(spec.seed)
    if spec.input_kind == "tokens":
        x = torch.randint(0, 11, spec.input_shape, generator=gen)
    else:
        x = torch.randn(spec.input_shape, generator=gen)
    return model, (x,)
