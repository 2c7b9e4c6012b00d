"""The graph modules an exported module is made of: the root and the blocks its graphs call.

``fxopt.rewrite.blocks.keep_blocks`` leaves each repeated block of the optimized module a
GraphModule at the block's own path that the root graph calls. The export writes each such
module as a class of its own whose ``forward`` is the block graph's generated code, so the
exported module has the optimized module's structure (``fully_shard(model.layers[i])`` works on
it). ``graph_modules`` finds them, nested ones too (a GraphModule a block's graph calls).

Blocks that compute the same share one class. Their graphs do not have the same node names
(``blocks_0_ln1`` and ``blocks_1_ln1``, ``add_1`` and ``add_3``: names are unique across the
graph the block was cut from), so the code is generated from ``renamed`` copies, named as if each
block had been traced on its own. Blocks whose code still differs (each holds checkpointed
regions of its own name, whose bodies read the block's state by its path) get a class each.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import fx

from fxopt.graph.graphs import graphs_of
from fxopt.core.torch_private import copy_codegen

_NUMBERED = re.compile(r"_\d+$")  # the suffix fx's namespace adds to make a name unique


def own_graphs(gm: fx.GraphModule) -> list[fx.Graph]:
    """``gm``'s graph, and its eval-mode graph when it has one: the code its class is written
    from (``fxopt.graph.graphs.graphs_of`` without the modules below it or the bodies)."""
    return [of.graph for of in graphs_of(gm, nested=False, bodies=False)]


def graph_modules(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """``("", gm)`` and (path, module) for every GraphModule a graph of one of them calls, in
    the order they are first called."""
    found = [("", gm)]
    for path, module in found:  # grows while it is walked: blocks nested in blocks
        for graph in own_graphs(module):
            for node in graph.find_nodes(op="call_module"):
                called = module.get_submodule(node.target)
                if isinstance(called, fx.GraphModule) and all(m is not called for _, m in found):
                    found.append((f"{path}.{node.target}" if path else node.target, called))
    return found


def input_names(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.find_nodes(op="placeholder")]


def shared_input_names(graphs: Sequence[fx.Graph]) -> list[str]:
    """Names for the inputs of graphs that share code: each input's own where all agree on it
    (``mean``, ``cos``), else ``input_<i>`` (the hidden state, named after what made it)."""
    columns = zip(*(input_names(g) for g in graphs), strict=True)
    return [names[0] if len(set(names)) == 1 else f"input_{i}" for i, names in enumerate(columns)]


def renamed(graph: fx.Graph, path: str, inputs: Sequence[str]) -> fx.Graph:
    """A copy of ``graph`` (the graph of the block at ``path``) named as if the block had been
    traced on its own: its placeholders named ``inputs``, a read or call of its state by the
    target (``attn_q_proj``), every other node by its name less the block's prefix
    (``blocks_0_``) and fx's numbering suffix, numbered again in the copy. Only the names differ:
    targets, arguments and the code generator are ``graph``'s."""
    prefix = path.replace(".", "_") + "_"
    copied = fx.Graph()
    copy_codegen(graph, copied)
    given = iter(inputs)
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        if node.op == "output":
            copied.output(args[0], type_expr=node.type)
            break
        if node.op == "placeholder":
            name = next(given)
        elif node.op in ("get_attr", "call_module"):  # targets are the block's own: fx's names
            name = node.target.replace(".", "_")
        else:
            name = _NUMBERED.sub("", node.name.removeprefix(prefix)) or node.op
        env[node] = copied.create_node(node.op, node.target, args, kwargs, name=name,
                                       type_expr=node.type)
        env[node].meta = dict(node.meta)
        if node.op == "placeholder":  # forward's parameter: the name, made unique if need be
            env[node].target = env[node].name
    return copied
