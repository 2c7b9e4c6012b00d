"""Compute a language model's head and cross-entropy over chunks of tokens.

After activation checkpointing, a language model's training peak is its loss: the batch x
sequence x vocab log-softmax saved for backward, its gradient and the logits' gradient. This pass
finds a scalar token-level cross-entropy over a vocabulary projection
(``fxopt.analysis.token_loss``: ``cross_entropy`` or ``log_softmax`` + ``nll_loss``, module-level
or ATen; any ``ignore_index``; ``label_smoothing``; mean or sum; the causal shift of Hugging Face
models, old (``logits[..., :-1, :]``) or new (shifted labels); upcasts, a final logit scaling and
Gemma 2's ``tanh`` soft-cap; tied embeddings) and rewrites the projection and the loss into one
call of ``fxopt.runtime.chunked_loss``, which computes the loss chunk by chunk and each chunk's
logit gradient in the forward, keeping only the gradients for the hidden states and the head's
weight (Liger's fused linear cross-entropy). The loss and every gradient are those of the
original, up to float rounding: the mean is over the non-ignored tokens of the whole call.

``outputs``:

- ``"all"`` (default, faithful): every output the model returns is still returned. When the
  logits (or a value computed from them) are used besides the loss -- Hugging Face causal LMs
  return them -- the call also returns the whole logits, written chunk by chunk, and gradients
  through them are right (distillation may backpropagate through them). The loss's path still
  holds no vocab-sized tensor besides them.
- ``"loss"``: for callers that read only the loss. Logits that the graph only returns are never
  built in a training step: where the model returned them, the output holds a
  ``fxopt.runtime.chunked_loss.LogitsNotComputed`` whose use (``.shape``, indexing, any torch
  function) raises an error that says why. With grad disabled (evaluation under
  ``torch.no_grad()``) they are computed and returned as before, and a model whose eval mode has
  its own graph (``fxopt.graph.train_eval``) returns them in eval mode. Logits the graph itself
  computes with (an accuracy, a z-loss), or returns sliced or reshaped, are built as with
  ``"all"``, and the stats say so. ``fxopt.verify`` accepts the placeholder where the original
  returned a tensor: the user asked for it.

``outputs`` left None takes the training's (``training.outputs``: ``fxopt.optimize(...,
outputs="loss")``). ``chunk_rows``: tokens per chunk, or ``"auto"``: left open in the graph
(``chunk_rows=None``: ``fxopt.runtime.chunked_loss.auto_chunk_rows`` at run time), where the
checkpoint pass, planning under a memory budget, sizes it as part of its plan
(``fxopt.planning.loss_chunks``). ``force``: rewrite even where the planner predicts no saving.
``budget``: set by ``fxopt.optimize``'s ``memory_budget`` (the pass joins the default pipeline
then, ``passes=None``): the rewrite is kept only when it lowers the predicted training peak of
the training planned for (``fxopt.analysis.estimate``, on a copy of the graph, its open chunks
at ``MIN_CHUNK_ROWS``, where the checkpoint plan starts sizing them); the stats give both
predictions and the loss's share of the peak before and after.

Left alone, with the reason in ``stats["skipped"]``: class weights, ``reduction="none"``,
probability targets, label smoothing or ignore_index computed in the graph, a projection with
hooks, a slice of the vocabulary or of the flattened logits, a logit transform not listed above
(e.g. a scale held in a tensor), targets computed from the logits, two losses over the same
logits. Not handled: a head module wrapped after optimization (FSDP's ``fully_shard(lm_head)``):
the call reads the head's weight directly, not through the module's hooks.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from fxopt.analysis.token_loss import TokenLoss, find_token_losses, is_assert, is_shape_read
from fxopt.analysis.estimate import estimate_train_peak
from fxopt.core.graphs import placeholder_values
from fxopt.graph.graphs import graph_module_like
from fxopt.core.errors import ConfigError
from fxopt.core.torch_private import copy_codegen
from fxopt.core.training_setup import OUTPUTS, TrainingSetup
from fxopt.planning.budget import parse_budget
from fxopt.planning.loss_chunks import MIN_CHUNK_ROWS, decide
from fxopt.rewrite.loss_chunk_calls import LossChunks
from fxopt.rewrite.pass_base import PassResult, graph_edited, mark_new
from fxopt.runtime.chunked_loss import (
    chunked_loss as chunked_loss_call,
)
from fxopt.runtime.chunked_loss import (
    chunked_loss_and_logits,
    logits_unless_grad,
)

PASS_NAME = "chunked_loss"


def chunked_loss(gm: fx.GraphModule, *, outputs: str | None = None,
                 chunk_rows: int | str = "auto", force: bool = False,
                 budget: int | float | str | None = None,
                 training: TrainingSetup | None = None) -> PassResult:
    """Rewrite each token-level cross-entropy over a vocabulary projection into a chunked call
    (module docstring)."""
    training = training or TrainingSetup()
    outputs = training.outputs if outputs is None else outputs
    if outputs not in OUTPUTS:
        raise ConfigError(f"chunked_loss: outputs={outputs!r} is not one of {OUTPUTS}",
                          hint="outputs='all' returns every output (default); outputs='loss' "
                               "never builds logits the model only returns")
    if chunk_rows != "auto" and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ConfigError(f"chunked_loss: chunk_rows={chunk_rows!r} is not 'auto' or a "
                          "positive int", hint="e.g. chunk_rows=128")
    if budget is not None:
        parse_budget(budget)  # a ConfigError before any work
    options = {"outputs": outputs, "chunk_rows": chunk_rows, "force": force}
    stats: dict[str, Any] = {"outputs": outputs}
    if budget is not None:  # the checkpoint pass sizes open chunks, from the smallest up
        options["planned"] = True
    if budget is not None and not force:
        # the planner's use: only where the predicted training peak goes down
        candidate = _copy(gm)
        records, skipped = _apply(candidate, **options)
        chunks = LossChunks(candidate)
        chunks.set(MIN_CHUNK_ROWS)  # as the checkpoint pass plans it
        if not records:
            return PassResult(gm, False, {**stats, "rewritten": 0, "sites": [],
                                          "skipped": skipped})
        inputs = placeholder_values(gm)
        before = estimate_train_peak(gm, inputs, training=training).bytes
        after = estimate_train_peak(candidate, inputs, training=training).bytes
        stats.update(predicted_before=before, predicted_after=after)
        if after >= before:
            skipped.update({r["loss"]: f"predicted training peak {after} B is not below "
                            f"{before} B" for r in records})
            return PassResult(gm, False, {**stats, "rewritten": 0, "sites": [],
                                          "skipped": skipped})
        chunks.set(None)  # open again: the checkpoint pass sizes it
        # the candidate is the rewrite, its meta refreshed: rewriting gm again would repeat
        # that refresh, a fake run of the whole graph (1.9 s on issue 36's 1B model)
        gm.graph = candidate.graph  # the setter recompiles gm
    else:
        records, skipped = _apply(gm, **options)
    for record in records:
        if "predicted_before" in stats:  # the loss's share of the predicted peak
            record["loss_share_before"] = round(
                record["predicted_removed_bytes"] / stats["predicted_before"], 3)
            record["loss_share_after"] = round(
                record["predicted_added_bytes"] / stats["predicted_after"], 3)
    return PassResult(gm, bool(records), {**stats, "rewritten": len(records), "sites": records,
                                          "skipped": skipped})


def _apply(gm: fx.GraphModule, *, outputs: str, chunk_rows: int | str, force: bool,
           planned: bool = False) -> tuple[list[dict[str, Any]], dict[str, str]]:
    findings = find_token_losses(gm)
    skipped: dict[str, str] = dict(findings.refused)
    records: list[dict[str, Any]] = []
    for site in findings.sites:
        decision = decide(site.tokens, site.vocab, site.hidden_size, site.itemsize,
                          chunk_rows=chunk_rows, force=force, planned=planned)
        if not decision.chunk:
            skipped[site.name] = decision.reason or "not worth it"
            continue
        record = _rewrite(gm, site, decision.chunk_rows, outputs)
        record.update(predicted_removed_bytes=decision.removed_bytes,
                      predicted_added_bytes=decision.added_bytes)
        records.append(record)
    if records:
        graph_edited(gm)
    return records, skipped


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph over the same module tree."""
    graph = fx.Graph()
    copy_codegen(gm.graph, graph)
    graph.output(graph.graph_copy(gm.graph, {}))
    candidate = graph_module_like(gm, graph)
    candidate.meta.update(gm.meta)
    return candidate


def _rewrite(gm: fx.GraphModule, site: TokenLoss, rows: int | None, outputs: str
             ) -> dict[str, Any]:
    graph = gm.graph
    uses = site.logits_uses
    dropped = []
    with graph.inserting_before(site.loss):
        weight = _state(gm, site.weight, site.loss)
        bias = _state(gm, site.bias, site.loss)
    if outputs == "loss" and uses and all(
            bound and site.transforms_to(value) is not None for value, _, bound in uses):
        for value, user, _ in uses:
            with graph.inserting_before(site.loss):
                placeholder = mark_new(graph.call_function(
                    logits_unless_grad, (site.hidden, weight, bias),
                    {"transforms": site.transforms_to(value)}), PASS_NAME)
            user.replace_input_with(value, placeholder)
            dropped.append(value.name)
        uses = []
    want_logits = bool(uses)
    # The call returns the logits as the uses read them when they all read one node reached by
    # element-wise transforms only (Hugging Face's upcast, Gemma 2's soft-cap); else the
    # projection's output, and the graph's own nodes compute what the uses read from it.
    read = {value for value, _, _ in uses}
    value = read.pop() if len(read) == 1 else site.head
    prefix = site.transforms_to(value)
    if prefix is None:
        value, prefix = site.head, ()
    with graph.inserting_before(site.loss):
        options = {"chunk_rows": rows, "ignore_index": site.ignore_index,
                   "label_smoothing": site.label_smoothing, "reduction": site.reduction,
                   "transforms": site.transforms, "row_slices": site.row_slices}
        if want_logits:
            options["logits_transforms"] = len(prefix)
        target = chunked_loss_and_logits if want_logits else chunked_loss_call
        call = mark_new(graph.call_function(target, (site.hidden, weight, bias, site.targets),
                                            options), PASS_NAME)
        if want_logits:
            loss = mark_new(graph.call_function(operator.getitem, (call, 0)), PASS_NAME)
            logits = mark_new(graph.call_function(operator.getitem, (call, 1)), PASS_NAME)
        else:
            loss, logits = call, None
    _move_after(graph, site.head, site.loss, loss if logits is None else logits)
    site.loss.replace_all_uses_with(loss)
    if logits is not None:
        if value is site.head:
            site.head.replace_all_uses_with(logits)
        else:
            for _, user, _ in uses:
                user.replace_input_with(value, logits)
    _erase_dead(graph, site)
    record = {"loss": site.name, "call": call.name, "tokens": site.tokens, "vocab": site.vocab,
              "hidden": site.hidden_size, "chunk_rows": "open" if rows is None else rows,
              "transforms": [list(map(str, t)) for t in site.transforms],
              "row_slices": [list(s) for s in site.row_slices]}
    if dropped:
        record["logits"] = (f"not computed in training (outputs='loss'; LogitsNotComputed "
                            f"returned): {', '.join(dropped)}")
    elif want_logits:
        readers = sorted({user.name for _, user, _ in uses})
        record["logits"] = ("returned, computed chunk by chunk" if all(b for *_, b in uses)
                            else f"built, chunk by chunk: read by {', '.join(readers)}")
        if outputs == "loss":
            record["logits"] += (" (outputs='loss' left them: the graph computes with them, or "
                                 "returns them sliced or reshaped)")
    else:
        record["logits"] = "not used besides the loss: never built"
    return record


def _state(gm: fx.GraphModule, value: fx.Node | str | None, before: fx.Node) -> Any:
    """A node for ``value``: itself, or a get_attr of a module's parameter (an existing one
    before ``before`` is reused)."""
    if not isinstance(value, str):
        return value
    for node in gm.graph.nodes:
        if node is before:
            break
        if node.op == "get_attr" and node.target == value:
            return node
    return mark_new(gm.graph.get_attr(value), PASS_NAME)


def _move_after(graph: fx.Graph, head: fx.Node, loss: fx.Node, anchor: fx.Node) -> None:
    """Move the nodes between ``head`` and ``loss`` that depend on ``head`` after ``anchor``
    (the call is placed just before ``loss``; the logits' users must follow it)."""
    order = list(graph.nodes)
    between = order[order.index(head) + 1:order.index(loss)]
    depends = {head}
    moving = []
    for node in between:
        if any(i in depends for i in node.all_input_nodes):
            depends.add(node)
            moving.append(node)
    last = anchor
    for node in moving:
        last.append(node)
        last = node


def _erase_dead(graph: fx.Graph, site: TokenLoss) -> None:
    """Erase the loss's old path where nothing reads it any more (with the checks on it, and
    the size arithmetic only it used)."""
    pending = set(site.path)
    changed = True
    while changed:
        changed = False
        for node in [n for n in reversed(graph.nodes) if n in pending]:
            if any(not is_assert(u) for u in node.users):
                continue
            inputs = node.all_input_nodes
            for check in list(node.users):
                graph.erase_node(check)
            graph.erase_node(node)
            pending.discard(node)
            pending.update(i for i in inputs if _size_arithmetic(i))
            changed = True


def _size_arithmetic(node: fx.Node) -> bool:
    """A shape read, or integer arithmetic on sizes: pure, and dead once unread."""
    if is_shape_read(node):
        return True
    return (node.op == "call_function" and node.target in _SIZE_OPS
            and not isinstance(node.meta.get("val"), torch.Tensor))


_SIZE_OPS = frozenset({operator.mul, operator.add, operator.sub, operator.floordiv})
