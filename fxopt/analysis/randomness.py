"""Which graph nodes draw from the random number generator: one answer for every planner that
moves nodes.

Two runs of a graph consume random numbers in the same order only if every RNG consumer keeps its
place relative to the others, so schedulers treat these nodes as ordered side effects. Covered:
torch's random factories and samplers, every dropout in every spelling (``fxopt.core.dropouts``),
``rrelu``, the in-place samplers of a tensor (``x.uniform_()``, ``x.bernoulli_()``, ...), the same
operations as ATen ops (graphs captured by torch.export), and random modules (``nn.Dropout*``,
``nn.RReLU``).

Not covered: an opaque leaf module or a user function that draws random numbers internally;
schedulers already treat every module they do not know as a side effect.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.core.dropouts import ATEN_DROPOUTS, DROPOUT_MODULES, FUNCTIONAL_DROPOUTS, TORCH_DROPOUTS

RANDOM_FUNCTIONS = frozenset({
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.multinomial,
    torch.normal, torch.poisson, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.rrelu, F.rrelu,
}) | TORCH_DROPOUTS | FUNCTIONAL_DROPOUTS

RANDOM_METHODS = frozenset({
    "bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "multinomial",
})

_aten = torch.ops.aten
RANDOM_ATEN_PACKETS = frozenset({
    _aten.rand, _aten.rand_like, _aten.randn, _aten.randn_like, _aten.randint, _aten.randint_like,
    _aten.randperm, _aten.bernoulli, _aten.bernoulli_, _aten.multinomial, _aten.normal,
    _aten.normal_, _aten.uniform, _aten.uniform_, _aten.random_, _aten.exponential_,
    _aten.geometric_, _aten.cauchy_, _aten.log_normal_, _aten.poisson, _aten.native_dropout,
    _aten.rrelu, _aten.rrelu_with_noise,
}) | frozenset(op.overloadpacket for op in ATEN_DROPOUTS)

RANDOM_MODULES = (*DROPOUT_MODULES, nn.RReLU)


def draws_random_numbers(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether running ``node`` consumes numbers from the global RNG (in training mode)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), RANDOM_MODULES)
    if node.op == "call_method":
        return node.target in RANDOM_METHODS
    if node.op != "call_function":
        return False
    if node.target in RANDOM_FUNCTIONS:
        return True
    packet = getattr(node.target, "overloadpacket", None)
    return packet in RANDOM_ATEN_PACKETS
