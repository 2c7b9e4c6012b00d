"""Transformer MLPs computed over chunks of tokens, so their wide intermediate is never held.

A transformer block's MLP widens each token 3-4x (Llama 3.2 1B: 2,048 -> 8,192) and autograd
saves that width several times over: the two projections, the activation and their product,
each batch x sequence x intermediate. This pass rewrites

- ``down(act(gate(x)) * up(x))`` (gated: Llama, Qwen, Mistral, Gemma) and
- ``down(act(up(x)))`` (GPT, BERT, ViT)

into ``fxopt.runtime.chunked_mlp.chunked_mlp``: forward computes the output a chunk of tokens at
a time and saves only ``x``; backward recomputes each chunk's projections and folds its gradients
into ``x``'s and the weights'. The saved intermediates are gone and the transient is one chunk,
sized so each of its tensors is about ``x``'s size; the price is the two input projections run
again in backward. Under a checkpointed region (the ``checkpoint`` pass runs after this one and
plans around the call), recomputing the region no longer rebuilds the MLP's intermediates, the
peak of a block's recompute in a language model.

When it acts: with ``memory_budget="min"`` (the least memory, where an extra forward of two
matmuls is the price the user chose), or ``force=True``. A fraction or a byte budget leaves MLPs
alone: the checkpoint planner does not weigh this rewrite against its regions.

Matched: ``linear`` as ``aten.linear`` (torch.export graphs), ``F.linear`` and ``nn.Linear``
calls without hooks; activations SiLU, ReLU and GELU (exact or tanh) as ATen ops, functions or
modules (in place or not); the gate product as ``aten.mul``, ``*`` or ``torch.mul``. Each value
between ``x`` and the output must have no other use, and the intermediate must be wider than
``x``. Left alone: anything between the projections (dropout, a cast, a norm), other activations,
and MLPs written as one fused op or module.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.core.errors import ConfigError
from fxopt.core.modules import has_hooks
from fxopt.rewrite.pass_base import PassResult, graph_edited, mark_new
from fxopt.runtime.chunked_mlp import chunk_rows
from fxopt.runtime.chunked_mlp import chunked_mlp as chunked_mlp_call

PASS_NAME = "chunked_mlp"
MIN_ROWS = 256  # tokens per chunk at least: a GPU wants large matmuls
aten = torch.ops.aten

_LINEAR = {aten.linear.default, F.linear}
_ACTIVATION_OPS = {
    aten.silu.default: "silu", aten.silu_.default: "silu", F.silu: "silu",
    aten.relu.default: "relu", aten.relu_.default: "relu", F.relu: "relu", torch.relu: "relu",
    torch.relu_: "relu", aten.gelu.default: "gelu", aten.gelu_.default: "gelu", F.gelu: "gelu",
}
_ACTIVATION_MODULES = {nn.SiLU: "silu", nn.ReLU: "relu", nn.GELU: "gelu"}
_MUL = {aten.mul.Tensor, operator.mul, torch.mul}


def chunked_mlp(gm: fx.GraphModule, *, budget: Any = None, force: bool = False,
                min_rows: int = MIN_ROWS) -> PassResult:
    """Rewrite each matched MLP into a chunked call (module docstring)."""
    if not isinstance(min_rows, int) or isinstance(min_rows, bool) or min_rows < 1:
        raise ConfigError(f"chunked_mlp: min_rows={min_rows!r} is not a positive int",
                          hint="e.g. min_rows=256 (tokens per chunk at least)")
    if not force and budget != "min":
        return PassResult(gm, False, {"rewritten": 0, "skipped": (
            "acts under memory_budget='min' (or force=true)")})
    sites, skipped = [], {}
    for node in list(gm.graph.nodes):
        mlp = _match(gm, node, min_rows)
        if mlp is None:
            continue
        if mlp["tokens"] is not None and mlp["rows"] >= mlp["tokens"]:
            skipped[node.name] = (f"one chunk at the example's {mlp['tokens']} tokens (at least "
                                  f"{min_rows} a chunk): the checkpoint pass's regions recompute "
                                  "it as cheaply")
            continue
        sites.append(_rewrite(gm, node, mlp))
    if sites:
        graph_edited(gm)
    return PassResult(gm, bool(sites), {"rewritten": len(sites), "sites": sites,
                                        "skipped": skipped})


def _rewrite(gm: fx.GraphModule, down: fx.Node, mlp: dict) -> dict:
    graph = gm.graph
    with graph.inserting_before(down):
        operands = [_operand(gm, value) for value in mlp["operands"]]
        call = mark_new(graph.call_function(
            chunked_mlp_call, (mlp["x"], *operands, mlp["activation"], mlp["min_rows"])),
            PASS_NAME)
    call.meta.update({k: v for k, v in down.meta.items() if k not in call.meta})
    down.replace_all_uses_with(call)
    for node in [down, *mlp["inner"]]:
        graph.erase_node(node)
    return {"call": call.name, "activation": mlp["activation"], "gated": mlp["gated"],
            "width": mlp["width"], "intermediate": mlp["intermediate"],
            "tokens": mlp["tokens"], "rows_per_chunk": mlp["rows"]}


def _operand(gm: fx.GraphModule, value: Any) -> Any:
    """A weight or bias as a graph value: a module's parameter name becomes a get_attr."""
    if isinstance(value, str):
        return mark_new(gm.graph.get_attr(value), PASS_NAME)
    return value


def _match(gm: fx.GraphModule, down: fx.Node, min_rows: int) -> dict | None:
    """The MLP ending in ``down``: its input, operands (gate w/b, up w/b, down w/b: nodes,
    parameter names or None), activation, the nodes the rewrite removes, and its sizes at the
    example (tokens, rows per chunk: None where a size is symbolic); None if ``down``
    does not end one the rewrite keeps exact (module docstring)."""
    down_linear = _linear(gm, down)
    if down_linear is None:
        return None
    hidden, down_w, down_b = down_linear
    if not _only_use(hidden, down):
        return None
    gated = hidden.op == "call_function" and hidden.target in _MUL and len(hidden.args) == 2 \
        and not hidden.kwargs
    if gated:
        first, second = hidden.args
        for act_node, up_node in ((first, second), (second, first)):
            found = _gated(gm, hidden, act_node, up_node)
            if found is not None:
                break
        else:
            return None
        (activation, act_node, gate_node, (x, gate_w, gate_b),
         up_node, (_, up_w, up_b)) = found
        inner = [hidden, act_node, up_node, gate_node]
    else:
        activation = _activation(gm, hidden)
        if activation is None:
            return None
        gate_node = hidden.args[0] if hidden.args else None
        gate = _linear(gm, gate_node) if isinstance(gate_node, fx.Node) else None
        if gate is None or not _only_use(gate_node, hidden):
            return None
        x, gate_w, gate_b = gate
        up_w = up_b = None
        inner = [hidden, gate_node]
    x_val, mid_val = x.meta.get("val"), gate_node.meta.get("val")
    if not isinstance(x_val, torch.Tensor) or not isinstance(mid_val, torch.Tensor) or \
            x_val.dim() < 2 or not isinstance(x_val.shape[-1], int) or \
            not isinstance(mid_val.shape[-1], int) or mid_val.shape[-1] <= x_val.shape[-1]:
        return None
    width, intermediate = x_val.shape[-1], mid_val.shape[-1]
    sizes = x_val.shape[:-1]  # fxopt's meta runs on the example: ints, unless one is symbolic
    tokens = math.prod(sizes) if all(isinstance(size, int) for size in sizes) else None
    return {"x": x, "operands": (gate_w, gate_b, up_w, up_b, down_w, down_b),
            "activation": activation, "gated": gated, "inner": inner, "width": width,
            "intermediate": intermediate, "tokens": tokens, "min_rows": min_rows,
            "rows": None if tokens is None else chunk_rows(tokens, width, intermediate,
                                                            min_rows)}


def _gated(gm: fx.GraphModule, product: fx.Node, act_node: Any, up_node: Any) -> tuple | None:
    if not isinstance(act_node, fx.Node) or not isinstance(up_node, fx.Node):
        return None
    activation = _activation(gm, act_node)
    up = _linear(gm, up_node)
    if activation is None or up is None or not _only_use(act_node, product) or \
            not _only_use(up_node, product):
        return None
    gate_node = act_node.args[0] if act_node.args else None
    gate = _linear(gm, gate_node) if isinstance(gate_node, fx.Node) else None
    if gate is None or gate_node is up_node or not _only_use(gate_node, act_node) or \
            gate[0] is not up[0]:
        return None
    return activation, act_node, gate_node, gate, up_node, up


def _linear(gm: fx.GraphModule, node: fx.Node) -> tuple | None:
    """``(x, weight, bias)`` of a linear node (weight and bias: nodes, names or None)."""
    if node.op == "call_function" and node.target in _LINEAR:
        given = dict(zip(("input", "weight", "bias"), node.args)) | dict(node.kwargs)
        x, weight, bias = given.get("input"), given.get("weight"), given.get("bias")
        if isinstance(x, fx.Node) and isinstance(weight, fx.Node) and \
                (bias is None or isinstance(bias, fx.Node)):
            return x, weight, bias
        return None
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs and \
            isinstance(node.args[0], fx.Node):
        module = gm.get_submodule(node.target)
        if type(module) is nn.Linear and not has_hooks(module):
            bias = f"{node.target}.bias" if module.bias is not None else None
            return node.args[0], f"{node.target}.weight", bias
    return None


def _activation(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The activation a node applies to its one tensor input, by its ``ACTIVATIONS`` name."""
    if node.op == "call_function" and node.target in _ACTIVATION_OPS:
        name = _ACTIVATION_OPS[node.target]
        extra = [a for a in node.args[1:] if a is not False]  # F.relu(x, False) & co.
        kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
        if name == "gelu":
            approximate = kwargs.pop("approximate", extra.pop(0) if extra else "none")
            name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
        return name if not extra and not kwargs else None
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        module = gm.get_submodule(node.target)
        name = _ACTIVATION_MODULES.get(type(module))
        if name is None or has_hooks(module):
            return None
        if name == "gelu":
            return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
        return name
    return None


def _only_use(value: Any, user: fx.Node) -> bool:
    return isinstance(value, fx.Node) and list(value.users) == [user]
