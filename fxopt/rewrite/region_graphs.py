"""The graphs a checkpointed region runs (``fxopt.runtime.regions.CheckpointedRegion``), cut out of
a graph when the checkpoint plan is applied; no edits to ``gm``.

``region_graphs(gm, nodes, kept)`` gives, for the contiguous run ``nodes``:

- ``body``: the run as a code-only GraphModule (``fxopt.rewrite.subgraph.extract_region``), and
  the ``targets`` its call site passes;
- ``forward`` (only when ``kept`` is not empty: a selective or light region): the body with each
  kept node between ``enter_kept(frame, base, *inner)`` and ``leave_kept(frame)`` (``inner``: its
  arguments that the recompute graph rebuilds, numbered from ``base`` in the recompute graph's
  result), returning ``(body's result, (kept outputs...))``;
- ``recompute``: what backward runs again, ``forward(self, *inputs, *kept outputs)``: the body
  without the kept nodes, which read their kept outputs instead, returning every ``inner``
  value in order. The body itself when nothing is kept and nothing below applies. BatchNorm is
  recomputed without writing its buffers: a ``BatchNorm1d/2d/3d`` call becomes
  ``recomputed_batch_norm(module, x)``, and ``F.batch_norm`` / ``aten.batch_norm`` (and
  instance norm) in training get scratch running statistics (``torch.empty_like`` of the
  buffers); a node that only writes a buffer (the counter's ``add_``) and whose value no node
  reads or differentiates is left out. Recomputation writes no buffer then, exactly as the
  forward writes them once (what it writes is never read: ``fxopt.planning.checkpoint_problem.
  writes_state`` keeps nodes that write a buffer someone reads out of regions).
- ``shield``: True when the recompute graph still writes a buffer (a module holding buffers other
  than a plain BatchNorm, a norm whose training flag is not a constant, another in-place write
  into a buffer that something depends on): that region recomputes over copies of its buffers.

The recompute graph runs exactly the nodes of the forward that save tensors for backward, in
the same order, with the same arguments (the kept outputs are the very tensors the forward
made), so what they save matches one to one (``fxopt.runtime.region_frame``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fxopt.analysis.writes import STATISTICS_UPDATERS, overwritten_inputs
from fxopt.core.modules import code_only_module
from fxopt.rewrite.subgraph import extract_region, placeholders, region_io
from fxopt.runtime.regions import enter_kept, leave_kept, recomputed_batch_norm

_PLAIN_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_TRAINING_FLAG = 5  # every STATISTICS_UPDATERS signature has training / use_input_stats here
_FLAG_NAMES = ("training", "use_input_stats")


@dataclass(frozen=True)
class RegionGraphs:
    body: fx.GraphModule
    targets: tuple[str, ...]
    forward: fx.GraphModule | None
    recompute: fx.GraphModule
    shield: bool


def region_graphs(gm: fx.GraphModule, nodes: list[fx.Node], kept: set[fx.Node],
                  roots: dict[fx.Node, fx.Node], *, all_kept_passed: bool = True) -> RegionGraphs:
    """The graphs of the region ``nodes`` keeping the outputs of ``kept`` (see the module doc);
    ``roots``: node -> the first node of its alias class (``checkpoint_problem.alias_roots``).
    ``all_kept_passed=False`` (a light region, which keeps most of its nodes): the forward hands
    the recomputation only the kept outputs a recomputed node reads; the others are freed as
    they would be without the region, and what the kept nodes save is kept as saved."""
    body, targets = extract_region(gm, nodes, class_name="CheckpointedBody")
    inputs, outputs = region_io(nodes)
    inside = set(nodes)
    order = [n for n in nodes if n in kept]
    inner = {node: [a for a in node.all_input_nodes if a in inside and a not in kept]
             for node in order}
    read = {a for n in nodes if n not in kept for a in n.all_input_nodes}
    passed = order if all_kept_passed else [n for n in order if n in read]
    forward = None
    if order:
        forward = code_only_module(_forward_graph(nodes, inputs, outputs, inner, passed), gm,
                                   "CheckpointedForward")
    graph, changed, shield = _recompute_graph(gm, nodes, inputs, inner, passed, roots)
    recompute = (code_only_module(graph, gm, "CheckpointedRecompute") if changed or order
                 else body)
    return RegionGraphs(body, targets, forward, recompute, shield)


def _copy_reads(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node]) -> None:
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and arg not in env:
            env[arg] = graph.node_copy(arg)


def _forward_graph(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                   inner: dict[fx.Node, list[fx.Node]], passed: list[fx.Node]) -> fx.Graph:
    graph = fx.Graph()
    frame = graph.placeholder("_fxopt_frame")
    env: dict[fx.Node, fx.Node] = {}
    placeholders(graph, inputs, env)
    base = 0
    for node in nodes:
        _copy_reads(graph, node, env)
        if node in inner:
            graph.call_function(enter_kept, (frame, base, *(env[a] for a in inner[node])))
            env[node] = graph.node_copy(node, lambda n: env[n])
            graph.call_function(leave_kept, (frame,))
            base += len(inner[node])
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    result = tuple(env[o] for o in outputs)
    graph.output((result[0] if len(result) == 1 else result, tuple(env[n] for n in passed)))
    return graph


def _recompute_graph(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node],
                     inner: dict[fx.Node, list[fx.Node]], passed: list[fx.Node],
                     roots: dict[fx.Node, fx.Node]) -> tuple[fx.Graph, bool, bool]:
    """(recompute graph, whether it differs from the body, whether it still writes buffers)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders(graph, [*inputs, *passed], env)
    changed = shield = False
    inside = set(nodes)
    for node in nodes:
        if node in inner:
            continue
        _copy_reads(graph, node, env)
        written = [w for w in overwritten_inputs(gm, node) if _is_buffer(roots.get(w, w))]
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if type(module) in _PLAIN_BATCH_NORMS and len(node.args) == 1 and not node.kwargs:
                owner = graph.get_attr(node.target)
                env[node] = graph.call_function(recomputed_batch_norm,
                                                (owner, env[node.args[0]]))
                env[node].meta = dict(node.meta)
                changed = True
                continue
            shield = shield or any(not b.requires_grad for b in module.buffers()) or bool(written)
        elif written and node.op == "call_function" and node.target in STATISTICS_UPDATERS:
            flag = (node.args[_TRAINING_FLAG] if len(node.args) > _TRAINING_FLAG
                    else next((node.kwargs[k] for k in _FLAG_NAMES if k in node.kwargs), False))
            if flag is True:
                scratch = {w: graph.call_function(torch.empty_like, (env[w],)) for w in written}
                env[node] = graph.node_copy(node, lambda n: scratch.get(n) or env[n])
                changed = True
                continue
            shield = shield or flag is not False
        elif written:
            if not node.users and not _requires_grad(node) and all(
                    u not in inside for u in node.users):
                changed = True  # only writes a buffer nothing reads: left out
                continue
            shield = True
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[a] for values in inner.values() for a in values))
    return graph, changed, shield


def _is_buffer(root: fx.Node) -> bool:
    return root.op == "get_attr"


def _requires_grad(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or val.requires_grad

