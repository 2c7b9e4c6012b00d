"""Lower the peak by changing the schedule: a memory-aware topological order.

``reorder(gm)`` asks ``fxopt.planning.schedule.choose_schedule`` for the legal order with the
lowest predicted peak (see there for the candidates and what "legal" means) and, when one beats
the original strictly, rebuilds the graph in that order. The graph changes only then.

Not handled: moving work across an opaque leaf module, a saving the static screen puts under
1% of the forward peak (not worth the fake runs that would confirm it), and any gain that needs
recomputation (that is the checkpoint pass's job).
"""

from __future__ import annotations

from torch import fx

from fxopt.core.training_setup import TrainingSetup
from fxopt.planning.schedule import choose_schedule, graph_in_order
from fxopt.rewrite.pass_base import PassResult

PASS_NAME = "reorder"


def reorder(gm: fx.GraphModule, *, train: bool = True,
            training: TrainingSetup | None = None) -> PassResult:
    """Schedule the graph in the order with the lowest predicted peak (train or inference) of
    the training ``training`` describes (``fxopt.TrainingSetup``)."""
    decision = choose_schedule(gm, train=train, training=training)
    if decision.order is None:
        return PassResult(gm, False, decision.stats)
    gm.graph = graph_in_order(gm.graph, decision.order)
    gm.recompile()
    return PassResult(gm, True, decision.stats)
