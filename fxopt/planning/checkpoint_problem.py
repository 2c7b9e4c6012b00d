"""Turn a traced graph into the solver's abstract CheckpointProblem (analysis only, no edits).

Values are storages: views and in-place results are folded into the node that owns the storage
(its alias-class representative), so a tensor saved through a view is counted once. Parameters,
buffers, constants and graph inputs never count: they are alive for the whole step anyway.
"""

from __future__ import annotations

import torch
from torch import fx

from fxopt.analysis import alias_classes, saved_for_backward
from fxopt.analysis.blocks import node_blocks
from fxopt.analysis.costmodel import node_costs, region_costs
from fxopt.analysis.estimate import released_gradients
from fxopt.analysis.randomness import draws_random_numbers
from fxopt.analysis.writes import overwritten_inputs
from fxopt.core import meta_keys
from fxopt.core.modules import has_hooks
from fxopt.core.graphs import placeholder_values
from fxopt.core.tensors import allocated_bytes, tensor_bytes
from fxopt.core.training_setup import TrainingSetup
from fxopt.planning.solver import CheckpointProblem, NodeInfo
from fxopt.runtime.fused_step import FusedOptimizers, fused_parameters
from fxopt.runtime.input_guard import guard_inputs
from fxopt.runtime.regions import call_region, region_inputs

_CALL_OPS = ("call_function", "call_method", "call_module")


def alias_roots(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """node -> the first node of its alias class (a placeholder or get_attr for values that are
    graph inputs, parameters or buffers, or views of them)."""
    classes = alias_classes(gm)
    first: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in classes:
            first.setdefault(classes[node], node)
    return {node: first.get(classes[node], node) if node in classes else node
            for node in gm.graph.nodes}


def representatives(gm: fx.GraphModule, roots: dict[fx.Node, fx.Node] | None = None
                    ) -> dict[fx.Node, fx.Node | None]:
    """node -> the first node of its alias class; None for classes rooted at inputs or params."""
    roots = alias_roots(gm) if roots is None else roots
    return {node: None if root.op in ("placeholder", "get_attr") else root
            for node, root in roots.items()}


def writes_state(gm: fx.GraphModule, written: list[fx.Node], roots: dict[fx.Node, fx.Node]
                 ) -> bool:
    """Whether a node that overwrites ``written`` in place (``fxopt.analysis.writes``) writes
    what the forward does not make: a graph input or a parameter (recomputing the node in a
    region would write it a second time), or a buffer whose value the graph reads
    (recomputation runs on a copy of the buffer as it is after the forward,
    ``fxopt.runtime.regions``, so it would compute from a value already written, not the one
    the forward read). A buffer only written -- BatchNorm's running statistics and its counter
    -- is safe: the copy takes the second write. Such a node must not be recomputed."""
    for value in written:
        root = roots.get(value, value)
        if root.op == "placeholder":
            return True
        if root.op != "get_attr":
            continue
        if _is_parameter(gm, root.target) or _state_is_read(gm, root, roots):
            return True
    return False


def _state_is_read(gm: fx.GraphModule, root: fx.Node, roots: dict[fx.Node, fx.Node]) -> bool:
    """Whether any node but the input guard uses the buffer ``root`` (or a view or in-place
    result of it) otherwise than by overwriting it."""
    members = [n for n, r in roots.items() if r is root]
    return any(user.target is not guard_inputs and member not in overwritten_inputs(gm, user)
               for member in members for user in member.users)


def _first_use_grad_bytes(gm: fx.GraphModule, forward: list[fx.Node],
                          fused_optimizer: FusedOptimizers,
                          released: frozenset[str] = frozenset()) -> dict[fx.Node, int]:
    """Bytes of trainable parameter gradients, charged to the first node that uses each; none
    for a parameter whose optimizer step ``fused_optimizer`` fuses into backward (its gradient
    is freed at the step, it does not pile up with the others), nor for those named in
    ``released`` (a sharded block's, reduce-scattered when the block's backward is done).

    The input guard reads every parameter only to check its dtype and device: no gradient flows
    through it. Charged there (the first node), every gradient would count as alive wherever
    backward is, and the solver could no longer tell plans apart by where in backward they peak."""
    seen: set[int] = {id(p) for p in fused_parameters(gm, fused_optimizer)}  # parameter ids
    seen.update(id(p) for name, p in gm.named_parameters(remove_duplicate=False)
                if name in released)
    charged: dict[fx.Node, int] = {}
    for node in forward:
        if node.target is guard_inputs:
            continue
        params = []
        if node.op == "call_module":
            params = list(gm.get_submodule(node.target).parameters())
        params += [gm.get_parameter(a.target) for a in node.all_input_nodes
                   if a.op == "get_attr" and _is_parameter(gm, a.target)]
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                charged[node] = charged.get(node, 0) + tensor_bytes(p)
    return charged


def _grad_live_bytes(forward: list[fx.Node], rep: dict[fx.Node, fx.Node | None],
                     value_bytes: dict[str, int]) -> list[int]:
    """Per forward node: bytes of activation gradients alive while its backward runs.

    A value's gradient exists in backward from the backward of its last reader down to the
    backward of its producer: the same stretch of nodes over which the value lives in forward.
    Counted per storage (views and in-place results share their base's), for values that
    require grad.

    These are the lifetimes of a step from one scalar, the model's own loss when it returns one
    (``fxopt.core.step.step_loss``): a causal LM's logits get their gradient only when backward
    reaches the loss that reads them. The random cotangents of a model without a loss are alive
    from the start of backward; the problem leaves them, like every plan-independent byte, to
    the search's overhead (``estimate_train_peak``, which runs that very step, minus the
    problem's own figure; ``fxopt.planning.checkpoint_search``).
    """
    index = {n: i for i, n in enumerate(forward)}
    span: dict[fx.Node, list[int]] = {}
    for node in forward:
        root = rep.get(node)
        if root is None or root.name not in value_bytes:
            continue
        val = root.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.requires_grad):
            continue
        readers = [index[u] for member in (node, root) for u in member.users if u in index]
        first, last = span.setdefault(root, [index[root], index[root]])
        span[root][1] = max([last, index[node], *readers])
    delta = [0] * (len(forward) + 1)
    for root, (first, last) in span.items():
        delta[first] += value_bytes[root.name]
        delta[last + 1] -= value_bytes[root.name]
    live, running = [], 0
    for change in delta[:-1]:
        running += change
        live.append(running)
    return live


def _loss_gradient_bytes(node: fx.Node, info) -> int:
    """Bytes of gradient a loss's backward builds for its own internal saved tensors: a
    cross-entropy keeps its log-softmax (batch x sequence x vocab) and returns a scalar, and its
    backward holds that tensor's gradient while it computes the logits'. Without it the plan
    that keeps the most at the end of forward looks no worse than one that keeps little, where
    the loss's backward is the step's peak (a Llama at vocab 1,200 lost to Hugging Face's
    checkpointing by it). Counted for a node with a scalar output only: the internal tensors of
    other nodes are at most a few times their output, and their gradients mostly the graph
    values' (``_grad_live_bytes``); counting them as well (attention with dropout on the math
    path: 35 times its output) made the solver's least-memory plans worse, not better."""
    if info is None or not info.internal_bytes:
        return 0
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.requires_grad and val.numel() == 1):
        return 0
    return info.internal_bytes


def _draws_random_numbers(gm: fx.GraphModule, node: fx.Node, costs: dict) -> bool:
    """Whether ``node`` draws random numbers in training: an op tagged so ran inside it on the
    fake run (``NodeCost.random``), the graph says so (``fxopt.analysis.randomness``), or it is an
    opaque leaf that ran for real, where no fake run looked inside."""
    return ((node in costs and costs[node].random) or draws_random_numbers(gm, node)
            or node.meta.get(meta_keys.META_SOURCE) == meta_keys.REAL)


def _holds_buffers(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` calls a module that holds buffers (which a recomputation would read as
    they are by then, not as the forward read them)."""
    return node.op == "call_module" and any(True for _ in gm.get_submodule(node.target).buffers())


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def build_problem(gm: fx.GraphModule, *, profile: bool = True,
                  training: TrainingSetup | None = None, regions_across_blocks: bool = False
                  ) -> tuple[CheckpointProblem, list[fx.Node]]:
    """The solver's view of ``gm``, and the forward nodes in the order the problem lists them.

    ``profile=False`` costs nodes by the roofline alone, at fixed rates
    (``fxopt.analysis.costmodel.node_costs``): the problem, and every plan made from it, is the
    same in every process.
    ``training``: the training step planned for (``fxopt.core.training_setup``): its precision,
    the user's fused optimizer step (a gradient freed at its step does not pile up) and
    per-block sharding (a block's gradients leave when its backward ends).
    ``regions_across_blocks``: let regions span repeated blocks (which then cannot stay calls).
    """
    training = training or TrainingSetup()
    roots = alias_roots(gm)
    rep = representatives(gm, roots)
    with training.precision():
        saved = saved_for_backward(gm, placeholder_values(gm))
    costs = node_costs(gm, profile=profile)
    forward = [n for n in gm.graph.nodes if n.op in _CALL_OPS]
    value_bytes: dict[str, int] = {}
    for node in forward:
        root = rep.get(node)
        if root is not None and root is node and allocated_bytes(node.meta.get("val")):
            value_bytes[node.name] = allocated_bytes(node.meta.get("val"))

    def names(nodes) -> frozenset[str]:
        return frozenset(rep[n].name for n in nodes
                         if rep.get(n) is not None and rep[n].name in value_bytes)

    in_block = node_blocks(gm, gm.graph)
    blocks = [in_block[node] for node in forward]
    grads = _first_use_grad_bytes(gm, forward, training.fused_optimizer,
                                  released_gradients(gm, training))
    grad_live = _grad_live_bytes(forward, rep, value_bytes)
    infos = []
    for i, node in enumerate(forward):
        info = saved.get(node)
        written = overwritten_inputs(gm, node)
        mutated = next((w for w in written if rep.get(w) is not None), None)
        random = _draws_random_numbers(gm, node, costs)
        infos.append(NodeInfo(
            name=node.name,
            seconds=costs[node].seconds if node in costs else 0.0,
            saved=names(info.values) if info else frozenset(),
            internal_bytes=info.internal_bytes if info else 0,
            reads=names(node.all_input_nodes),
            heavy=costs[node].heavy if node in costs else False,
            # A region is not checkpointed again; the input guard runs once, before any region;
            # a write into an input, a parameter or a buffer read later must happen once; so
            # must a call of a module with hooks, which run as on the user's model: once.
            recomputable=(node.target not in (call_region, region_inputs, guard_inputs)
                          and not writes_state(gm, written, roots)
                          and not (node.op == "call_module"
                                   and has_hooks(gm.get_submodule(node.target)))),
            mutates=rep[mutated].name if mutated is not None and rep.get(mutated) else None,
            grad_bytes=grads.get(node, 0),
            grad_live_bytes=grad_live[i] + _loss_gradient_bytes(node, info),
            block=blocks[i],
            random=random,
            # recomputed by a light region: nothing but light ops, no state written or read
            light=(node in costs and costs[node].light and not random and not written
                   and not _holds_buffers(gm, node)),
        ))
    region_seconds, saved_seconds = region_costs(gm, profile=profile)
    return CheckpointProblem(infos, value_bytes, regions_across_blocks=regions_across_blocks,
                             region_seconds=region_seconds, saved_seconds=saved_seconds), forward
