"""Keep the model's repeated blocks as submodules the optimized graph calls.

Capture inlines every module: a traced GPT's graph calls the Linear and LayerNorm leaves of each
block directly, an exported Llama reads every parameter at the top of ``forward``. ``keep_blocks``
runs after the passes and gives the structure back: each repeated block
(``fxopt.analysis.blocks``) becomes a GraphModule at the block's own path that owns the block's
submodules, parameters and buffers (the same objects, in the same order, so ``state_dict`` keys
do not change), and the root graph calls it, ``getattr(self.model.layers, "0")(hidden, cos,
sin)``. The block's graph reads its own parameters when it is called. So ``fully_shard(block)``
gathers them around that call, ``torch.compile(block)`` compiles it, and hooks a script
registers on a block fire as on the user's model. The block holds the scalar attributes of the
module it stands for (``fxopt.core.modules.constant_values``: a layer's ``hidden_size``, a flag),
so a script reads them as on the user's model; set anew, the optimized module's call guard
refuses the call (``fxopt.integrations.call_guard``): the block's graph has them built in.

A checkpointed region lies in one block (the planner sees to it), so its call moves into the
block with it. What a block reads that is not its own (a rotary table the root computes, a
tied weight, a size) the root graph passes in. A module with a graph per training mode has both
graphs nested, and each block dispatches on its own ``training`` flag the way the root does
(``fxopt.graph.train_eval``); the block takes the inputs of both modes, ``None`` for those the
other mode does not read.

When it is safe: always, as a regrouping of the same nodes into one call. Nodes that sit between
a block's first and last node without depending on it run before the block's call, those that
depend on it after. A block stays flat (inlined in the root graph, reason in
``gm.meta["fxopt_blocks"]``) when that cannot be done without changing what is computed: a
computation that depends on the block and feeds back into it, an in-place write across the
block's boundary with other nodes in between, a call of a module outside the block, or a block
only one mode's graph can call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx, nn

from fxopt.analysis.blocks import node_blocks
from fxopt.analysis.writes import overwritten_inputs
from fxopt.graph.pickling import refuse_pickling
from fxopt.graph.train_eval import (
    eval_graph,
    install_eval_graph,
    replace_eval_graph,
)
from fxopt.graph.graphs import graph_module_like
from fxopt.graph.sequential import keep_sequential_interface
from fxopt.core import meta_keys
from fxopt.core.modules import (
    carry_constants,
    own_children,
    own_tensors,
    replace_child,
)
from fxopt.rewrite.pass_base import PassResult, mark_new
from fxopt.runtime.regions import CheckpointedRegion

PASS_NAME = "keep_blocks"

META_KEY = meta_keys.BLOCKS


@dataclass
class BlocksInfo:
    """``gm.meta["fxopt_blocks"]``: the blocks kept as calls, and those left flat with why."""

    kept: list[str] = field(default_factory=list)
    flat: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Segment:
    """One block's stretch of one graph, and how it connects to the rest."""

    path: str
    nodes: list[fx.Node]                      # the block's nodes, in graph order
    inputs: dict[str, fx.Node]                # placeholder name -> value the root passes
    local: dict[fx.Node, str]                 # get_attr node -> target relative to the block
    carried: dict[fx.Node, str]               # get_attr of a plain root attribute -> new name
    outputs: list[fx.Node]
    after: list[fx.Node]                      # nodes inside the stretch that run after the call


def keep_blocks(gm: fx.GraphModule) -> PassResult:
    """Nest every repeated block of ``gm`` (and of its eval-mode graph) as a called submodule."""
    info = BlocksInfo()
    eval_g = eval_graph(gm)
    nested = 0
    for path in _block_paths(gm, gm.graph):
        if _already_called(gm.graph, path):
            info.kept.append(path)
            continue
        train, why = _segment(gm, gm.graph, path)
        evaluation = None
        if train is not None and eval_g is not None:
            evaluation, why = _segment(gm, eval_g, path)
            why = why and why + " (eval-mode graph)"
        if train is None or (eval_g is not None and evaluation is None):
            info.flat.append((path, why))
            continue
        names = list(train.inputs) + [n for n in (evaluation.inputs if evaluation else ())
                                      if n not in train.inputs]
        _install_block(gm, train, evaluation, names)
        _call_block(gm.graph, train, names)
        if evaluation is not None:
            _call_block(eval_g, evaluation, names)
        info.kept.append(path)
        nested += 1
    if nested:
        for graph in (gm.graph, eval_g):
            for node in graph.find_nodes(op="get_attr") if graph is not None else ():
                if not node.users:  # a read of a block's state nothing uses any more
                    graph.erase_node(node)
        _drop_unused_root_attributes(gm, eval_g)
        gm.recompile()
        if eval_g is not None:
            replace_eval_graph(gm, eval_g)
    gm.meta[META_KEY] = info
    return PassResult(gm, bool(nested), {"kept": list(info.kept), "flat": list(info.flat)})


def blocks(module: nn.Module) -> list[str]:
    """The paths of the blocks ``module`` (what ``fxopt.optimize`` returned) calls as
    submodules, in call order: the units to ``fully_shard`` (then the root) or to compile one
    by one. ``[]`` for a module ``keep_blocks`` never ran on."""
    info = getattr(module, "meta", {}).get(META_KEY)
    return list(info.kept) if info is not None else []


def _already_called(graph: fx.Graph, path: str) -> bool:
    """Whether ``graph`` calls block ``path`` as one module call (a graph nested before)."""
    return any(n.op == "call_module" and n.target == path for n in graph.nodes)


def _block_paths(gm: fx.GraphModule, graph: fx.Graph) -> list[str]:
    return list(dict.fromkeys(b for b in node_blocks(gm, graph).values() if b is not None))


def _segment(gm: fx.GraphModule, graph: fx.Graph, path: str) -> tuple[_Segment | None, str]:
    """The stretch of ``graph`` block ``path`` runs, or (None, why it cannot be one call)."""
    blocks = node_blocks(gm, graph)
    nodes = [n for n in graph.nodes if blocks[n] == path]
    if not nodes:
        return None, "the graph does not run it"
    inside = set(nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = order[nodes[0]], order[nodes[-1]]
    window = [n for n in graph.nodes if first < order[n] < last and n not in inside
              and n.op != "get_attr"]
    after: list[fx.Node] = []
    depends = set(inside)
    for node in window:
        if any(a in depends for a in node.all_input_nodes):
            depends.add(node)
            after.append(node)
            if any(u in inside for u in node.users):
                return None, f"{node.name} depends on the block and feeds back into it"
    moved = [n for n in window if n not in depends]
    if any(overwritten_inputs(gm, n) for n in window):
        return None, "an in-place write runs between the block's nodes"
    written_outside = [a for n in nodes for a in overwritten_inputs(gm, n) if a not in inside]
    if written_outside and moved:
        return None, f"it writes {written_outside[0].name} in place while other nodes run between its own"
    prefix = path + "."
    inputs: dict[str, fx.Node] = {}
    local: dict[fx.Node, str] = {}
    carried: dict[fx.Node, str] = {}
    for node in nodes:
        if node.op == "call_module" and not node.target.startswith(prefix):
            return None, f"it calls {node.target}, a module outside it"
        for arg in node.all_input_nodes:
            if arg in inside:
                continue
            if arg.op == "get_attr" and arg.target.startswith(prefix):
                local[arg] = arg.target[len(prefix):]
            elif arg.op == "get_attr" and not _registered(gm, arg.target):
                carried[arg] = arg.target.replace(".", "_")
            else:
                inputs.setdefault(arg.name, arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return _Segment(path, nodes, inputs, local, carried, outputs, after), ""


def _registered(gm: fx.GraphModule, target: str) -> bool:
    """Whether ``target`` is a registered submodule, parameter or buffer (state the block must
    receive from the root), not a plain attribute (a region, a body, a constant) it may hold."""
    owner_path, _, name = target.rpartition(".")
    try:
        owner = gm.get_submodule(owner_path)
    except AttributeError:
        return False
    parameters, buffers = own_tensors(owner)
    return name in own_children(owner) or name in parameters or name in buffers


def _block_graph(segment: _Segment, names: list[str]) -> fx.Graph:
    """The block's graph: placeholders ``names`` (unused ones stay), the block's nodes with
    module targets made relative, its outputs (one value, or a tuple)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in names:
        placeholder = graph.placeholder(name)
        value = segment.inputs.get(name)
        if value is not None:
            placeholder.meta = dict(value.meta)
            env[value] = placeholder
    for node, target in {**segment.local, **segment.carried}.items():
        env[node] = graph.get_attr(target)
        env[node].meta = dict(node.meta)
    prefix = segment.path + "."
    for node in segment.nodes:
        copied = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_module":
            copied.target = node.target[len(prefix):]
        env[node] = copied
    results = tuple(env[o] for o in segment.outputs)
    graph.output(results[0] if len(results) == 1 else results)
    return graph


def _install_block(gm: fx.GraphModule, train: _Segment, evaluation: _Segment | None,
                   names: list[str]) -> fx.GraphModule:
    """Replace the block's module in ``gm`` by a GraphModule over the same tree."""
    shell = gm.get_submodule(train.path)
    carried = {**train.carried, **(evaluation.carried if evaluation else {})}
    for node, name in carried.items():
        object.__setattr__(shell, name, operator.attrgetter(node.target)(gm))
    block = graph_module_like(shell, _block_graph(train, names))
    keep_sequential_interface(block, shell)
    for name in carried.values():
        if not hasattr(block, name):
            object.__setattr__(block, name, shell.__dict__[name])
    for name in carried.values():
        shell.__dict__.pop(name, None)
    block.training = shell.training
    carry_constants(shell, block)
    if evaluation is not None:
        install_eval_graph(block, _block_graph(evaluation, names))
        refuse_pickling(block)
    parent_path, _, name = train.path.rpartition(".")
    replace_child(gm.get_submodule(parent_path), name, block)
    return block


def _call_block(graph: fx.Graph, segment: _Segment, names: list[str]) -> None:
    """Replace the block's nodes in ``graph`` by one call of the block."""
    last = segment.nodes[-1]
    with graph.inserting_after(last):
        call = graph.call_module(segment.path, tuple(segment.inputs.get(n) for n in names))
    call.meta[meta_keys.NN_MODULE_STACK] = {segment.path: (segment.path, "block")}
    mark_new(call, PASS_NAME)
    values = [o.meta.get("val") for o in segment.outputs]
    anchor = call
    if len(segment.outputs) == 1:
        call.meta["val"] = values[0]
        replacements = [call]
    else:
        call.meta["val"] = tuple(values)
        replacements = []
        for index, output in enumerate(segment.outputs):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (call, index))
            anchor.meta = {"val": output.meta.get("val")}
            mark_new(anchor, PASS_NAME)
            replacements.append(anchor)
    for node in segment.after:
        anchor.append(node)
        anchor = node
    inside = set(segment.nodes)
    for output, replacement in zip(segment.outputs, replacements, strict=True):
        output.replace_all_uses_with(replacement, delete_user_cb=lambda u: u not in inside)
    for node in reversed(segment.nodes):
        graph.erase_node(node)
    for node in list(segment.local) + list(segment.carried):
        if not node.users:
            graph.erase_node(node)


def _drop_unused_root_attributes(gm: fx.GraphModule, eval_g: fx.Graph | None) -> None:
    """Plain attributes of the root (regions, bodies) that only blocks read now."""
    read = {n.target for g in (gm.graph, eval_g) if g is not None
            for n in g.find_nodes(op="get_attr")}
    for name, value in list(vars(gm).items()):
        if name not in read and isinstance(value, (CheckpointedRegion, fx.GraphModule)):
            delattr(gm, name)
