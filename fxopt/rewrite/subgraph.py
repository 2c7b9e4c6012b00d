"""Cut a contiguous run of nodes out of a graph as a GraphModule of its own (no edits to ``gm``).

Used wherever a piece of a traced model must run as one callable: checkpointed regions
(passes/checkpoint.py) and the stages of the ``checkpoint_sequential`` peer (fxopt/peers.py).

The body's placeholders are the values the run reads from outside (in first-use order), its
outputs the values read after it; ``get_attr`` nodes are copied in, so the body resolves the
same parameters, buffers and submodules as ``gm`` (the body's root is ``gm``: nothing is copied).
"""

from __future__ import annotations

from torch import fx


def region_io(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(values the run reads from outside it, values of the run read outside it)."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr" and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return inputs, outputs


def extract_subgraph(gm: fx.GraphModule, nodes: list[fx.Node], *,
                     class_name: str = "Subgraph") -> fx.GraphModule:
    """A GraphModule computing ``nodes``: ``body(*inputs) -> output`` (a tuple if several)."""
    inputs, outputs = region_io(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
        env[node] = graph.node_copy(node, lambda n: env[n])
    result = tuple(env[o] for o in outputs)
    graph.output(result[0] if len(result) == 1 else result)
    return fx.GraphModule(gm, graph, class_name=class_name)
