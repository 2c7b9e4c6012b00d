"""Cut a contiguous run of nodes out of a graph as a GraphModule of its own (no edits to ``gm``).

Used wherever a piece of a traced model must run as one callable: checkpointed regions
(passes/checkpoint.py) and the stages of the ``checkpoint_sequential`` peer (fxopt/bench/peers.py).

The body's placeholders are the values the run reads from outside (in first-use order), its
outputs the values read after it; ``get_attr`` and ``call_module`` nodes keep their targets.
``extract_subgraph`` gives a module over ``gm``'s own parameters, buffers and submodules (a
stage that runs on its own); ``extract_region`` gives code only, plus the targets its call site
must pass (``fxopt.runtime.regions``), so nothing is resolved when the body is built.
"""

from __future__ import annotations

import operator

from torch import fx, nn

from fxopt.core.modules import code_only_module


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
    return fx.GraphModule(gm, _subgraph(nodes), class_name=class_name)


def extract_region(gm: fx.GraphModule, nodes: list[fx.Node], *,
                   class_name: str = "Subgraph") -> tuple[fx.GraphModule, tuple[str, ...]]:
    """(code-only body computing ``nodes``, the targets it reads through ``self``).

    Run as ``type(body).forward(state, *inputs)`` where ``state`` resolves each target. A
    target under another one that is a module (``layers.0.weight`` beside ``layers.0``) is not
    listed: it is read through that module.
    """
    graph = _subgraph(nodes)
    targets = tuple(dict.fromkeys(n.target for n in graph.nodes
                                  if n.op in ("get_attr", "call_module")))
    modules = {t for t in targets if isinstance(operator.attrgetter(t)(gm), nn.Module)}
    passed = tuple(t for t in targets
                   if not any(t.startswith(m + ".") for m in modules if m != t))
    return code_only_module(graph, gm, class_name), passed


def placeholders(graph: fx.Graph, values: list[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    """A placeholder of ``graph`` for each of ``values`` (its name and meta), recorded in
    ``env``: how a graph cut out of another starts."""
    for value in values:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)


def _subgraph(nodes: list[fx.Node]) -> fx.Graph:
    inputs, outputs = region_io(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders(graph, inputs, env)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
        env[node] = graph.node_copy(node, lambda n: env[n])
    result = tuple(env[o] for o in outputs)
    graph.output(result[0] if len(result) == 1 else result)
    return graph
