"""Checks the pipeline runs on the graph after every pass.

A pass must leave: a well-formed graph (``Graph.lint``); ``meta["val"]`` on every value node;
``meta["fxopt_pass"]`` on every node it created; the same ``state_dict`` keys and shapes and the
same Parameter objects (the user's); and, when it says ``modified=False``, a graph identical to
the one it was given.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from fxopt.core import meta_keys
from fxopt.core.errors import PassError


@dataclass(frozen=True)
class GraphSnapshot:
    node_names: frozenset[str]
    code: str
    state_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    param_ids: tuple[int, ...]


def snapshot(gm: fx.GraphModule) -> GraphSnapshot:
    return GraphSnapshot(
        node_names=frozenset(n.name for n in gm.graph.nodes),
        code=gm.code,
        state_shapes=tuple((k, tuple(v.shape)) for k, v in gm.state_dict(keep_vars=True).items()),
        param_ids=tuple(id(p) for _, p in gm.named_parameters(remove_duplicate=False)),
    )


def graph_problems(gm: fx.GraphModule, before: GraphSnapshot) -> list[str]:
    """Everything wrong with ``gm`` relative to ``before``; empty when the graph is sound."""
    problems = []
    try:
        gm.graph.lint()
    except Exception as error:
        problems.append(f"graph lint failed: {error}")
    for node in gm.graph.nodes:
        if node.op != "output" and "val" not in node.meta:
            problems.append(f"node {node.name} ({node.op} {node.target}) has no meta['val']")
        if node.name not in before.node_names and meta_keys.PASS not in node.meta:
            problems.append(f"new node {node.name} has no meta['fxopt_pass'] provenance")
    after = snapshot(gm)
    if after.state_shapes != before.state_shapes:
        problems.append("state_dict keys or shapes changed")
    if after.param_ids != before.param_ids:
        problems.append("parameters are no longer the user's Parameter objects")
    return problems


def lint_after_pass(gm: fx.GraphModule, before: GraphSnapshot, pass_name: str,
                    modified: bool, where: str) -> None:
    problems = graph_problems(gm, before)
    if not modified and gm.code != before.code:
        problems.append("pass returned modified=False but changed the generated code")
    if problems:
        raise PassError(
            f"pass {pass_name!r} left a broken graph: " + "; ".join(problems[:5]),
            where=where,
            hint="leave the pass out and report the bug; dump the graphs with dump_dir to see "
            "what it produced",
        )
