"""Activation checkpointing under a memory budget, planned by fxopt.planning.solver.

``checkpoint(gm, budget=...)`` picks regions of the forward to recompute in backward so that the
predicted peak of a training step stays at or under ``budget`` with the least recompute time,
and rewrites each region into a call of a ``CheckpointedRegion`` (non-reentrant
``torch.utils.checkpoint`` with RNG replay, selective recomputation that keeps conv/matmul
outputs where the plan says so, and BatchNorm buffers shielded from recomputation).

Budget: bytes (int), a size string ("2GiB", "300MB"), or a fraction 0 < f <= 1 of the
unoptimized *activation memory* (the live bytes at the predicted training peak minus parameters,
buffers, inputs and the parameter gradients alive at that moment; ``TrainPeak.activation_bytes``):
budget = peak - (1 - f) * activations. ``"min"``: the least-memory plan
the solver finds, whatever it costs in recompute time (no ``BudgetError``; the graph is left as
it is when no plan predicts less than the original).

Prediction: the solver's model is checked against ``estimate_peak`` (a fake-tensor run of the
rewritten forward *and* backward, recomputation included); when the model was optimistic the
budget given to the solver is lowered by the overshoot and the plan re-solved, so the predicted
peak never exceeds the budget. An impossible budget raises ``BudgetError`` with the smallest peak
this pass can reach. Where no value forward saved for backward is alive at the unoptimized
peak and still held for backward (``TrainPeak.saved_values_at_peak``: it comes at the end of
backward, say, with every gradient and the returned logits alive, or a gradient the chunked loss
made in forward and its backward passed on), no region can lower it, so no plan is searched (no
problem built, no node timed): ``"min"`` leaves the graph as it is, a lower budget raises.

Recompute time: each forward node is timed once on the real device (``fxopt.analysis.node_timing``), so two
runs can settle on different near-equal plans. ``profile=False`` plans from the FLOPs/bytes
roofline instead: no real compute, and the same plan on every run and every DDP rank, at the price
of a cost model that can be far off on CPU (BatchNorm 8x, max-pool 40x in our measurements).

The training planned for: ``training`` (``fxopt.TrainingSetup``, what ``fxopt.optimize`` was
told) is read by the plan and by every prediction. Its precision (autocast) sets the sizes of
what is saved; a fused optimizer step (``fxopt.fuse_optimizer``) frees each gradient at its step
in backward, where otherwise every gradient lives to the end of backward; per-block FSDP2
(``sharded_blocks``) makes a block's parameter gradients leave (reduce-scattered) when its
backward is done instead of piling up, which moves the best plan towards recomputing whole
blocks (``fxopt.analysis.blocks.block_parameter_names``).

The chunked loss's chunk is a variable of the same plan. A chunked-loss call whose size is left
open (``passes.chunked_loss`` with ``chunk_rows="auto"``: ``chunk_rows=None`` in the graph) is
planned at ``MIN_CHUNK_ROWS`` tokens, the least the loss can hold; once the regions are chosen it
gets the widest chunk (a power of two up to the device's ``fast_chunk_rows``) whose predicted
peak stays within the budget (``"min"``: within the plan's predicted peak), since small chunks
are slow (``fxopt.planning.loss_chunks``). ``stats["loss_chunk_rows"]`` says which.

An opaque leaf (``fxopt.capture.leaf_recording``) is recomputed like any call, with RNG replayed; one
that writes its inputs in place only together with the node that made that input.

Not handled: graphs already containing checkpointed regions (left as they are: the pass is
idempotent).
"""

from __future__ import annotations

import operator
import time
import warnings
from dataclasses import dataclass
from typing import Any

from torch import fx

from fxopt.analysis.estimate import estimate_train_peak
from fxopt.core.graphs import placeholder_values
from fxopt.graph.graphs import graph_module_like
from fxopt.core.tensors import format_bytes
from fxopt.core.torch_private import copy_codegen
from fxopt.core.training_setup import TrainingSetup
from fxopt.planning.budget import budget_bytes, is_min
from fxopt.planning.checkpoint_problem import alias_roots, build_problem
from fxopt.planning.checkpoint_search import least_memory_plan, search_plan, unreachable_budget
from fxopt.planning.loss_chunks import MIN_CHUNK_ROWS, fast_chunk_rows
from fxopt.planning.solver import LIGHT, SELECTIVE, CheckpointPlan
from fxopt.rewrite.loss_chunk_calls import LossChunks
from fxopt.rewrite.pass_base import PassResult, StatsItem, graph_edited, mark_new
from fxopt.analysis.blocks import module_span
from fxopt.rewrite.region_graphs import region_graphs
from fxopt.rewrite.subgraph import region_io
from fxopt.runtime.regions import CheckpointedRegion, call_region, region_inputs

PASS_NAME = "checkpoint"


@dataclass(frozen=True)
class RegionStats(StatsItem):
    """One checkpointed region, in the pass's ``stats["regions"]``: named as the user knows the
    model (``module``: the deepest module all of it runs in, ``model.layers.3``; ``from_module``
    .. ``to_module``: where it starts and ends), and by the attribute and graph nodes of the
    optimized module."""

    region: str               # the attribute of the module that holds it
    first: str                # its first and last node
    last: str
    nodes: int
    mode: str                 # full or selective
    predicted_extra_ms: float  # recompute time in backward, predicted
    kept_bytes_saved: int     # bytes no longer kept for backward
    rebuilt_bytes: int        # bytes its recomputation rebuilds in backward
    module: str = ""          # the deepest module it runs in ("": the root)
    from_module: str = ""     # the module its first and last node run in
    to_module: str = ""

    def where(self) -> str:
        """``model.layers.3 (self_attn.q_proj .. mlp.down_proj)``: module paths, relative to the
        common module inside the parentheses."""
        common = self.module or "the model's own forward"
        inside = [_relative(m, self.module) for m in (self.from_module, self.to_module)]
        inside = [m for m in dict.fromkeys(inside) if m]
        return f"{common} ({' .. '.join(inside)})" if inside else common

    def line(self) -> str:
        return (f"{self.region:<18} {self.mode:<9} {self.nodes:>3} nodes in {self.where()}, "
                f"nodes {self.first} .. {self.last}: keeps "
                f"{format_bytes(self.kept_bytes_saved)} less, rebuilds "
                f"{format_bytes(self.rebuilt_bytes)} in backward, "
                f"+{self.predicted_extra_ms:.2f} ms predicted")


def _why_nothing_lowers(estimate: Any, loss_chunked: bool) -> str:
    """In words, why ``"min"`` checkpoints nothing: what the predicted peak is made of, and
    whether any value saved for backward is alive at it (if none is, no plan was searched)."""
    parts = [f"{format_bytes(estimate.baseline_bytes)} parameters, buffers and inputs"]
    if estimate.grad_bytes:
        parts.append(f"{format_bytes(estimate.grad_bytes)} parameter gradients")
    if estimate.optimizer_step_bytes:
        parts.append(f"{format_bytes(estimate.optimizer_step_bytes)} of the fused optimizer step")
    parts.append(f"{format_bytes(estimate.activation_bytes)} activations and backward "
                 "temporaries")
    why = (f"no plan predicts less than the original: nothing is checkpointed, because no "
           f"region recomputed in backward lowers the predicted peak of "
           f"{format_bytes(estimate.bytes)}, reached at {estimate.op} with "
           f"{', '.join(parts[:-1])} and {parts[-1]} alive")
    if not estimate.saved_values_at_peak:
        why += (" (none of them a value forward saved for backward, which is all a region can "
                "drop: no plan was searched)")
    if loss_chunked:
        why += ("; the chunked loss sizes its token chunks to this peak (loss_chunk_rows): "
                "what \"min\" saves here comes from the loss")
    return why


def _relative(path: str, common: str) -> str:
    if not common or path == common:
        return "" if path == common else path
    return path.removeprefix(common + ".")


def apply_plan(gm: fx.GraphModule, forward: list[fx.Node], plan: CheckpointPlan
               ) -> list[RegionStats]:
    """Rewrite each planned region of ``gm`` into a checkpointed call; returns one record each.

    A region's graphs (``fxopt.rewrite.region_graphs``): its body, the recompute graph backward
    runs, and for a selective region the forward that hands the outputs of the nodes the plan
    keeps (``Region.kept``) to the recomputation; its RNG state is replayed only when one of its
    nodes draws random numbers (``Region.random``)."""
    records = []
    existing = sum(1 for name in vars(gm) if name.startswith("_fxopt_region_"))
    roots = alias_roots(gm)
    for number, region in enumerate(plan.regions, start=existing):
        nodes = forward[region.start:region.stop]
        name = f"_fxopt_region_{number}"
        kept = {forward[i] for i in region.kept}
        module, first, last = module_span(nodes)
        graphs = region_graphs(gm, nodes, kept, roots, all_kept_passed=region.mode != LIGHT)
        setattr(gm, name, CheckpointedRegion(
            graphs.body, selective=region.mode in (SELECTIVE, LIGHT), targets=graphs.targets,
            forward=graphs.forward, recompute=graphs.recompute, random=region.random,
            shield=graphs.shield, boxed=True, light=region.mode == LIGHT))
        _replace_with_call(gm, nodes, name, graphs.targets)
        records.append(RegionStats(name, nodes[0].name, nodes[-1].name, len(nodes), region.mode,
                                   round(region.extra_seconds * 1e3, 3), region.freed_bytes,
                                   region.recompute_bytes, module, first, last))
    return records


def _replace_with_call(gm: fx.GraphModule, nodes: list[fx.Node], attr: str,
                       targets: tuple[str, ...]) -> None:
    """``call_region(self.<attr>, region_inputs(*inputs), *state)``: the inputs are handed over
    in a list the region empties (so under ``no_grad`` each is freed at its last use in the body),
    and the state the body reads is looked up on the root by the call site, at call time (an
    existing ``get_attr`` before the region is reused)."""
    inputs, outputs = region_io(nodes)
    graph = gm.graph
    looked_up: dict[str, fx.Node] = {}
    for node in graph.nodes:
        if node is nodes[0]:
            break
        if node.op == "get_attr":
            looked_up.setdefault(node.target, node)
    with graph.inserting_before(nodes[0]), warnings.catch_warnings():
        # fx warns that a plain attribute is no submodule/parameter/buffer: deliberate here
        warnings.simplefilter("ignore", UserWarning)
        region = mark_new(graph.get_attr(attr), PASS_NAME)
        state = [looked_up.get(t) or mark_new(graph.get_attr(t), PASS_NAME) for t in targets]
        box = mark_new(graph.call_function(region_inputs, tuple(inputs)), PASS_NAME)
        call = mark_new(graph.call_function(call_region, (region, box, *state)), PASS_NAME)
    if len(outputs) == 1:
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in nodes)
    else:
        for index, out in enumerate(outputs):
            with graph.inserting_after(call):
                item = mark_new(graph.call_function(operator.getitem, (call, index)), PASS_NAME)
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in nodes)
    for node in reversed(nodes):
        graph.erase_node(node)


def _already_checkpointed(gm: fx.GraphModule) -> bool:
    return any(n.target is call_region for n in gm.graph.nodes)


def _predict(gm: fx.GraphModule, forward: list[fx.Node], plan: CheckpointPlan,
             training: TrainingSetup) -> int:
    """Predicted train peak of ``gm`` with ``plan`` applied (on a copy; ``gm`` is untouched)."""
    mapping: dict[fx.Node, fx.Node] = {}
    graph = fx.Graph()
    copy_codegen(gm.graph, graph)
    graph.output(graph.graph_copy(gm.graph, mapping))
    candidate = graph_module_like(gm, graph)
    apply_plan(candidate, [mapping[n] for n in forward], plan)
    candidate.recompile()
    return estimate_train_peak(candidate, placeholder_values(gm), training=training).bytes


def checkpoint(gm: fx.GraphModule, *, budget: int | float | str = 0.5,
               max_region_atoms: int = 16, profile: bool = True,
               regions_across_blocks: bool = False,
               training: TrainingSetup | None = None) -> PassResult:
    """Recompute the cheapest regions in backward so the predicted train peak fits ``budget``,
    and size the chunked loss's open chunks with the plan (module docstring).

    A region lies in one repeated block or outside all of them, so the blocks stay calls of
    their own (``fxopt.rewrite.blocks``: per-block FSDP2 and torch.compile);
    ``regions_across_blocks=True`` lifts that, for a module that is never sharded or compiled
    per block (what it buys: ``benchmarks/block_structure.py``)."""
    if _already_checkpointed(gm):
        return PassResult(gm, False, {"reason": "graph already has checkpointed regions"})
    started = time.perf_counter()
    training = training or TrainingSetup()
    loss_calls = LossChunks(gm)
    loss_calls.set(MIN_CHUNK_ROWS)  # planned around the least the loss can hold
    estimate = estimate_train_peak(gm, placeholder_values(gm), training=training,
                                   watch_saved=True)
    peak, activations = estimate.bytes, estimate.activation_bytes
    target = budget_bytes(budget, peak=peak, activations=activations)
    stats: dict[str, Any] = {"budget_bytes": target, "predicted_before": peak,
                             "activation_bytes": activations}
    where = f"checkpoint pass, budget={budget!r}"
    gradients = 0 if estimate.fused.parameters else estimate.grad_bytes
    beyond_reach = peak > target and not estimate.saved_values_at_peak
    if beyond_reach and not is_min(budget):
        raise unreachable_budget(target, peak, peak, where=where, activations=activations,
                                 gradients=gradients)
    problem, forward = (None, []) if beyond_reach else build_problem(
        gm, profile=profile, training=training, regions_across_blocks=regions_across_blocks)
    predict = lambda candidate: _predict(gm, forward, candidate, training)  # noqa: E731
    plan, predicted = CheckpointPlan(), peak
    if peak <= target:
        pass
    elif is_min(budget):
        found = None if beyond_reach else least_memory_plan(problem, predict, max_region_atoms)
        if found is not None and found[0] < peak:
            predicted, plan = found
            stats["budget_bytes"] = predicted
        else:
            stats["budget_bytes"] = peak  # the least reachable: the peak as it is
            stats["reason"] = _why_nothing_lowers(estimate, bool(loss_calls))
    else:
        predicted, plan = search_plan(
            problem, target=target, unoptimized_peak=peak, predict=predict,
            max_region_atoms=max_region_atoms, where=where, activations=activations,
            gradients=gradients)
    if loss_calls:
        limit = predicted if is_min(budget) else max(target, predicted)
        rows = loss_calls.widest(lambda: predict(plan) <= limit, fast_chunk_rows(training.device))
        stats["loss_chunk_rows"] = rows
    stats["predicted_after"] = predicted
    if plan.empty:
        return PassResult(gm, bool(loss_calls), stats)
    stats["regions"] = apply_plan(gm, forward, plan)
    graph_edited(gm)
    stats.update({"regions_count": len(plan.regions),
                  "predicted_extra_ms": round(plan.extra_seconds * 1e3, 3),
                  "solver_seconds": round(plan.solve_seconds, 3),
                  "seconds": round(time.perf_counter() - started, 3)})
    return PassResult(gm, True, stats)
