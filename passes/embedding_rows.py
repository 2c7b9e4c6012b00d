"""Embedding lookups whose weight gradient the fused optimizer step takes in rows.

With the optimizer step fused into backward (``fxopt.fuse_optimizer``, passed to ``optimize`` as
``fused_optimizer=``), every gradient is freed at its step; but torch's embedding backward makes
a language model's token-embedding gradient dense, vocab x hidden, although a batch looks up a
few thousand of its rows (Llama 3's 128,256 x 2,048 in bfloat16: 501 MiB). This pass rewrites
each lookup of a parameter that step frees in backward into
``fxopt.runtime.embedding_rows.embedding_rows``: the same lookup, whose backward hands the step a
function computing one block of rows at a time (``FusedOptimizer.defer_gradient_rows``), so the
dense gradient is never made. Forward, the gradient and the update are unchanged; where the step
is paused or gone, the call runs torch's own backward.

Rewritten: ``aten.embedding`` (torch.export graphs), ``F.embedding`` and ``torch.embedding``
calls, and calls of ``nn.Embedding`` modules without hooks, whose weight is such a parameter.
Left alone: ``max_norm`` (it renormalises the weight in place), ``scale_grad_by_freq`` and
``sparse`` lookups, and every lookup when the training step has no fused step that frees
gradients in backward (``stats["skipped"]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.core.modules import has_hooks
from fxopt.core.training_setup import TrainingSetup
from fxopt.rewrite.pass_base import PassResult, graph_edited, mark_new
from fxopt.runtime.embedding_rows import embedding_rows as embedding_rows_call
from fxopt.runtime.fused_step import fused_parameters

PASS_NAME = "embedding_rows"
_ATEN = torch.ops.aten.embedding.default


def embedding_rows(gm: fx.GraphModule, *, training: TrainingSetup | None = None) -> PassResult:
    """Rewrite the lookups of parameters the fused step frees in backward (module docstring)."""
    training = training or TrainingSetup()
    stepped = {id(p) for p in fused_parameters(gm, training.fused_optimizer)}
    if not stepped:
        return PassResult(gm, False, {"rewritten": [], "skipped": (
            "no fused optimizer step frees gradients in backward (fused_optimizer=)")})
    rewritten = []
    for node in list(gm.graph.nodes):
        lookup = _lookup(gm, node)
        if lookup is None:
            continue
        weight, indices, padding_idx = lookup
        if id(_parameter(gm, weight)) not in stepped:
            continue
        with gm.graph.inserting_before(node):
            if isinstance(weight, str):
                weight = mark_new(gm.graph.get_attr(weight), PASS_NAME)
            call = mark_new(gm.graph.call_function(
                embedding_rows_call, (weight, indices, padding_idx)), PASS_NAME)
        call.meta.update({k: v for k, v in node.meta.items() if k not in call.meta})
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        rewritten.append(call.name)
    if rewritten:
        graph_edited(gm)
    return PassResult(gm, bool(rewritten), {"rewritten": rewritten})


def _lookup(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, Any, int] | None:
    """``(weight node or qualified name, indices, padding_idx)`` of an embedding lookup the
    rewrite keeps exact; None for anything else."""
    if node.op == "call_function" and node.target in (_ATEN, torch.embedding):
        names = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")
        given = dict(zip(names, node.args)) | dict(node.kwargs)
        if given.get("scale_grad_by_freq") or given.get("sparse"):
            return None
        return given["weight"], given["indices"], int(given.get("padding_idx", -1))
    if node.op == "call_function" and node.target is F.embedding:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type",
                 "scale_grad_by_freq", "sparse")
        given = dict(zip(names, node.args)) | dict(node.kwargs)
        if given.get("max_norm") is not None or given.get("scale_grad_by_freq") or \
                given.get("sparse"):
            return None
        return given["weight"], given["input"], _padding(given.get("padding_idx"),
                                                           given["weight"], gm)
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        module = gm.get_submodule(node.target)
        if type(module) is nn.Embedding and module.max_norm is None and \
                not module.scale_grad_by_freq and not module.sparse and not has_hooks(module):
            padding_idx = -1 if module.padding_idx is None else module.padding_idx
            return f"{node.target}.weight", node.args[0], padding_idx
    return None


def _padding(padding_idx: int | None, weight: Any, gm: fx.GraphModule) -> int:
    """F.embedding's ``padding_idx`` as torch.embedding takes it (-1: none)."""
    if padding_idx is None:
        return -1
    if padding_idx < 0:
        parameter = _parameter(gm, weight)
        return -1 if parameter is None else parameter.shape[0] + padding_idx
    return padding_idx


def _parameter(gm: fx.GraphModule, weight: Any) -> nn.Parameter | None:
    """The parameter a weight argument reads: a get_attr node or a qualified name."""
    target = weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" else weight
    if not isinstance(target, str):
        return None
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return None
