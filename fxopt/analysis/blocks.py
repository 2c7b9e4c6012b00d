"""Which repeated block of the model each node of a graph runs in (analysis only, no edits).

A *block* is the outermost numbered item of a ``ModuleList`` or ``Sequential`` that has
submodules of its own: ``model.layers.3`` (Llama), ``transformer.h.0`` (GPT-2), ``layer1.0``
(ResNet's Bottleneck). It is the unit Hugging Face's gradient checkpointing, torchtitan's
per-layer FSDP2 and per-block ``torch.compile`` work on, so fxopt keeps blocks as calls
(``fxopt.rewrite.blocks``) and never lets a checkpointed region span two of them. A numbered
single layer (``features.3``, a conv) is not a block.

The block of a node is read off the module stack both capture frontends record
(``node.meta["nn_module_stack"]``); a node traced in the root's own forward has none. A node a
pass made (``meta["fxopt_pass"]``) and an item of a multi-output call run in the block their
inputs come from when they all agree on one, else at the root. A region call runs in the one
block all of its body's nodes run in, and so does the hand-over of its inputs
(``region_inputs``).
"""

from __future__ import annotations

import operator

from torch import fx, nn

from fxopt.core import meta_keys
from fxopt.runtime.regions import CheckpointedRegion, call_region, region_inputs


def repeated_block(root: nn.Module, node: fx.Node) -> str | None:
    """The block ``node``'s module stack places it in, or None (see the module docstring)."""
    for path, _kind in meta_keys.module_stack(node):
        block = block_of_path(root, str(path))
        if block is not None:
            return block
    return None


def block_of_path(root: nn.Module, path: str) -> str | None:
    """The outermost block ``path`` (a module path) lies in, or None."""
    parts = path.split(".")
    for end, part in enumerate(parts):
        if not part.isdigit():
            continue
        prefix = ".".join(parts[:end + 1])
        try:
            module = root.get_submodule(prefix)
        except AttributeError:
            return None
        if next(module.children(), None) is not None:
            return prefix
    return None


def node_blocks(root: nn.Module, graph: fx.Graph) -> dict[fx.Node, str | None]:
    """node -> the block it runs in (None: at the root), for every node of ``graph``.

    ``root`` is the module the graph runs on (its targets resolve there). Placeholders, the
    output and ``get_attr`` nodes are at the root: an attribute belongs to whichever block reads
    it.
    """
    blocks: dict[fx.Node, str | None] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            blocks[node] = None
        elif meta_keys.module_stack(node):
            blocks[node] = repeated_block(root, node)
        elif node.op == "call_function" and node.target is call_region:
            blocks[node] = _region_block(root, node)
            box = node.args[1] if len(node.args) > 1 else None
            if isinstance(box, fx.Node) and box.target is region_inputs:
                blocks[box] = blocks[node]  # the hand-over runs where the region does
        elif meta_keys.PASS in node.meta or node.target is operator.getitem:
            found = {blocks[a] for a in node.all_input_nodes if a.op != "get_attr"}
            blocks[node] = found.pop() if len(found) == 1 else None
        else:  # traced in the root's own forward
            blocks[node] = None
    return blocks


def _region_block(root: nn.Module, node: fx.Node) -> str | None:
    region = node.args[0]
    if not (isinstance(region, fx.Node) and region.op == "get_attr"):
        return None
    value = operator.attrgetter(region.target)(root)
    graph = getattr(getattr(value, "body", None), "graph", None)
    if not isinstance(value, CheckpointedRegion) or graph is None:
        return None
    inner = {repeated_block(root, n) for n in graph.nodes
             if n.op.startswith("call_") and meta_keys.module_stack(n)}
    return inner.pop() if len(inner) == 1 else None


def block_parameter_names(root: nn.Module, graph: fx.Graph) -> frozenset[str]:
    """Qualified names of the parameters of every block ``graph``'s nodes run in: the ones
    FSDP2, sharding each block, reduce-scatters as soon as the block's backward is done."""
    paths = {b for b in node_blocks(root, graph).values() if b is not None}
    return frozenset(f"{path}.{name}" for path in paths
                     for name, _ in root.get_submodule(path).named_parameters())


def module_span(nodes: list[fx.Node]) -> tuple[str, str, str]:
    """Where ``nodes`` run, as a user names their model: ``(module, first, last)``, the deepest
    module every node with a recorded module stack runs in (``"model.layers.3"``; ``""``: the
    root) and the innermost module of the first and of the last such node
    (``"model.layers.3.self_attn.q_proj"``, ``"model.layers.3.mlp.down_proj"``). All ``""``
    when no node has a module stack (nodes a pass made)."""
    stacks = [[path for path, _ in meta_keys.module_stack(n)] for n in nodes]
    stacks = [s for s in stacks if s]
    if not stacks:
        return "", "", ""
    common: list[str] = []
    for level in zip(*stacks):
        if any(path != level[0] for path in level):
            break
        common.append(level[0])
    return (common[-1] if common else ""), stacks[0][-1], stacks[-1][-1]
