"""Turn a traced graph into the solver's abstract CheckpointProblem (analysis only, no edits).

Values are storages: views and in-place results are folded into the node that owns the storage
(its alias-class representative), so a tensor saved through a view is counted once. Parameters,
buffers, constants and graph inputs never count: they are alive for the whole step anyway.
"""

from __future__ import annotations

import torch
from torch import fx

from fxopt.analysis import alias_classes, saved_for_backward
from fxopt.analysis.costmodel import node_costs
from fxopt.analysis.writes import overwritten_inputs
from fxopt.capture.meta import placeholder_values
from fxopt.core.tensors import allocated_bytes, tensor_bytes
from fxopt.planning.solver import CheckpointProblem, NodeInfo
from fxopt.runtime.fused_step import fused_parameters
from fxopt.runtime.input_guard import guard_inputs
from fxopt.runtime.regions import call_region

_CALL_OPS = ("call_function", "call_method", "call_module")


def representatives(gm: fx.GraphModule) -> dict[fx.Node, fx.Node | None]:
    """node -> the first node of its alias class; None for classes rooted at inputs or params."""
    classes = alias_classes(gm)
    first: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in classes:
            first.setdefault(classes[node], node)
    rep: dict[fx.Node, fx.Node | None] = {}
    for node in gm.graph.nodes:
        root = first.get(classes[node], node) if node in classes else node
        rep[node] = None if root.op in ("placeholder", "get_attr") else root
    return rep


def _first_use_grad_bytes(gm: fx.GraphModule, forward: list[fx.Node]) -> dict[fx.Node, int]:
    """Bytes of trainable parameter gradients, charged to the first node that uses each; none
    for a parameter whose optimizer step is fused into backward (its gradient is freed at the
    step, it does not pile up with the others)."""
    seen: set[int] = {id(p) for p in fused_parameters(gm)}  # parameter ids
    charged: dict[fx.Node, int] = {}
    for node in forward:
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


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def repeated_block(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The outermost numbered module with submodules of its own that ``node`` runs in
    (``model.layers.3``, ``layer1.0``): a ModuleList's or Sequential's item that is a block, not
    a single layer (``features.3``, a conv, gives no block: its conv starts an atom anyway).
    Read off the module stack both frontends record."""
    for path, _kind in (node.meta.get("nn_module_stack") or {}).values():
        parts = str(path).split(".")
        for end, part in enumerate(parts):
            if not part.isdigit():
                continue
            prefix = ".".join(parts[:end + 1])
            try:
                module = gm.get_submodule(prefix)
            except AttributeError:
                return None
            if next(module.children(), None) is not None:
                return prefix
    return None


def build_problem(gm: fx.GraphModule, *, profile: bool = True
                  ) -> tuple[CheckpointProblem, list[fx.Node]]:
    """The solver's view of ``gm``, and the forward nodes in the order the problem lists them.

    ``profile=False`` costs nodes by the roofline alone (``fxopt.analysis.costmodel.node_costs``).
    """
    rep = representatives(gm)
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

    blocks = [repeated_block(gm, node) for node in forward]
    grads = _first_use_grad_bytes(gm, forward)
    grad_live = _grad_live_bytes(forward, rep, value_bytes)
    infos = []
    for i, node in enumerate(forward):
        info = saved.get(node)
        mutated = next(iter(overwritten_inputs(gm, node)), None)
        infos.append(NodeInfo(
            name=node.name,
            seconds=costs[node].seconds if node in costs else 0.0,
            saved=names(info.values) if info else frozenset(),
            internal_bytes=info.internal_bytes if info else 0,
            reads=names(node.all_input_nodes),
            heavy=costs[node].heavy if node in costs else False,
            # A region is not checkpointed again; the input guard runs once, before any region.
            recomputable=node.target not in (call_region, guard_inputs),
            mutates=rep[mutated].name if mutated is not None and rep.get(mutated) else None,
            grad_bytes=grads.get(node, 0),
            grad_live_bytes=grad_live[i],
            block=blocks[i],
        ))
    return CheckpointProblem(infos, value_bytes), forward
