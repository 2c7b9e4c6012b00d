"""The graphs of an optimized module, and GraphModules built over another module's tree.

``graphs_of(module)`` is the one definition of "every graph of a module": for each GraphModule
in ``module``'s tree (the root, its kept blocks), its train-mode graph, its eval-mode graph when
it dispatches on ``self.training`` (``fxopt.graph.train_eval``), and the bodies of the
checkpointed regions it calls (plain attributes holding code only: their targets resolve on the
root). Every analysis, pass and export that walks graphs walks these. ``called_paths`` and
``recomputed_paths`` read from them which modules an optimized module calls as modules, and
which of those a checkpointed region runs again in backward.

``graph_module_like(shell, graph)`` makes a GraphModule over ``shell``'s own module tree, for
captures and for the copies passes predict on.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx, nn

from fxopt.core.modules import (
    copy_hooks,
    deepcopy_keeping_hooks,
    set_instance_method,
    share_tree,
    wrap_own_calls,
)
from fxopt.graph.pickling import reloadable
from fxopt.graph.train_eval import dispatched_eval_module, eval_graph
from fxopt.runtime.regions import CheckpointedRegion

TRAIN, EVAL, REGION, BODY = "train", "eval", "region", "body"


@dataclass(frozen=True)
class GraphOf:
    """One graph of a module. ``host``: the GraphModule of the module tree (at ``path`` from
    the root) whose code runs it, and on which its ``get_attr`` and ``call_module`` targets
    resolve (a region's body reads its targets from the root: look there too). ``kind``:
    ``TRAIN`` (the host's graph), ``EVAL`` (its eval-mode graph), ``REGION`` (a checkpointed
    region's body) or ``BODY`` (a grad-mode or autocast scope's body, held as a plain attribute);
    ``where`` says it in words."""

    path: str
    host: fx.GraphModule
    graph: fx.Graph
    kind: str
    where: str


def graphs_of(module: nn.Module, *, nested: bool = True, bodies: bool = True) -> list[GraphOf]:
    """Every graph of ``module``, each once (module docstring). ``nested=False``: ``module``'s
    own graphs only, not those of the GraphModules below it (kept blocks); ``bodies=False``:
    without region and scope bodies."""
    found: list[GraphOf] = []
    seen: set[int] = set()

    def visit(path: str, host: fx.GraphModule, gm: fx.GraphModule, kind: str,
              where: str) -> None:
        if id(gm) in seen:
            return
        seen.add(id(gm))
        found.append(GraphOf(path, host, gm.graph, kind, where))
        in_eval = eval_graph(gm)
        if in_eval is not None:
            found.append(GraphOf(path, host, in_eval, EVAL, f"{where} (eval)"))
        if not bodies:
            return
        for name, region in regions_of(gm).items():
            if isinstance(region.body, fx.GraphModule):
                visit(path, host, region.body, REGION, f"{where}.{name}.body")
        for name, value in vars(gm).items():
            if isinstance(value, fx.GraphModule):
                visit(path, host, value, BODY, f"{where}.{name}")

    owners = module.named_modules() if nested else [("", module)]
    for path, owner in owners:
        if isinstance(owner, fx.GraphModule):
            visit(path, owner, owner, TRAIN, path or "<root>")
    return found


def called_paths(module: nn.Module) -> frozenset[str]:
    """The paths of the modules ``module``'s graphs call as modules, where their hooks run (and
    FSDP2's, which gather a sharded module's parameters around its call): the root, the kept
    blocks, the leaf modules called, in every graph of ``graphs_of(module)``. Every other
    module in the tree has its operations run inline, reading its parameters directly."""
    called = {""}
    for of in graphs_of(module):
        for node in of.graph.find_nodes(op="call_module"):
            if of.kind == REGION or not of.path:
                called.add(node.target)
            else:
                called.add(f"{of.path}.{node.target}")
    return frozenset(called)


def graph_running(root: nn.Module, path: str, called: frozenset[str]) -> str | None:
    """The path of the module whose graph runs the module at ``path`` inline (``called`` is
    ``called_paths(root)``, which ``path`` is not in): the innermost called module above it, the
    root (``""``) or a kept block, which runs its eval-mode graph when its own flag is off. None
    when that is a module called as a plain module (a leaf), whose own ``forward`` then calls
    its submodules, in their own modes."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        above = ".".join(parts[:end])
        if above in called:
            return above if isinstance(root.get_submodule(above), fx.GraphModule) else None
    return ""


def inlined_paths(root: nn.Module) -> dict[str, str]:
    """path -> ``graph_running`` of every module ``root``'s graphs run inline: all but those
    called and those under a module called as a plain module (whose own ``forward`` runs them)."""
    called = called_paths(root)
    running = {path: graph_running(root, path, called) for path, _ in root.named_modules()
               if path and path not in called}
    return {path: runner for path, runner in running.items() if runner is not None}


def recomputed_with_what_they_call(root: nn.Module) -> frozenset[str]:
    """``recomputed_paths`` and every module under each: a region that runs a leaf again runs
    what the leaf's own ``forward`` calls again too."""
    return frozenset(path for again in recomputed_paths(root)
                     for path, _ in root.get_submodule(again).named_modules(prefix=again))


def recomputed_paths(module: nn.Module) -> frozenset[str]:
    """The paths of the modules a checkpointed region of ``module`` runs again in backward: those
    its recompute graph calls, and the BatchNorm modules it hands to ``recomputed_batch_norm``
    (which computes their batch statistics without calling them). Region targets are paths
    from the root."""
    paths: set[str] = set()
    for owner in module.modules():
        if not isinstance(owner, fx.GraphModule):
            continue
        for region in regions_of(owner).values():
            if not isinstance(region.recompute, fx.GraphModule):
                continue
            for node in region.recompute.graph.nodes:
                if node.op == "call_module" or (
                        node.op == "get_attr"
                        and isinstance(_resolved(module, node.target), nn.Module)):
                    paths.add(node.target)
    return frozenset(paths)


def regions_of(gm: fx.GraphModule) -> dict[str, CheckpointedRegion]:
    """The checkpointed regions ``gm`` holds, by attribute name: plain attributes (code, no
    state), which its graph hands to ``fxopt.runtime.regions.call_region``."""
    return {name: value for name, value in vars(gm).items()
            if isinstance(value, CheckpointedRegion)}


def _resolved(module: nn.Module, target: str) -> object:
    try:
        return operator.attrgetter(target)(module)
    except AttributeError:
        return None


def graph_module_like(shell: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule whose module tree *is* ``shell``'s, so state_dict keys and order match.

    fx would otherwise copy only the attributes the graph uses (dropping unused parameters, and
    modules only reached through a checkpointed region) and register tracer constants as buffers
    (adding state_dict keys). Plain attributes the graph reads stay plain attributes, and so do
    those the eval-mode graph reads when ``graph``'s code dispatches on ``self.training``
    (``fxopt.graph.train_eval``): that graph runs with the new module as ``self``, so a
    constant only it reads (a mask the eval graph built) must be there too. ``shell``'s own hooks
    are copied: tracing ran its ``forward``, not its hooks, which must run when the GraphModule
    is called.
    """
    wrap_own_calls(graph)  # torch.load re-traces the code: fxopt's calls must stay calls
    gm = reloadable(fx.GraphModule(shell, graph, class_name=type(shell).__name__))
    constants = {n.target: operator.attrgetter(n.target)(gm) for n in graph.nodes
                 if n.op == "get_attr"}
    eval_module = dispatched_eval_module(graph)
    if eval_module is not None:  # code only: what its graph reads is on ``shell``
        for node in eval_module.graph.find_nodes(op="get_attr"):
            if node.target not in constants:
                constants[node.target] = operator.attrgetter(node.target)(shell)
    share_tree(gm, shell)
    for target, value in constants.items():
        owner_path, _, name = target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        if not hasattr(owner, name):
            # A tracer-made constant: a plain attribute, not a buffer, so not in state_dict.
            object.__setattr__(owner, name, value)
    gm.training = shell.training  # submodules keep their own flags (a frozen BN stays in eval)
    copy_hooks(shell, gm)
    set_instance_method(gm, "__deepcopy__", deepcopy_keeping_hooks)
    return gm


