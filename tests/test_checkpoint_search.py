"""fxopt.planning.checkpoint_search: the least-memory plan is the least *predicted* of several
candidates, each predicted once, ties broken the same way in every process."""

import pytest
from test_solver import pre_norm_layers

from fxopt.core.errors import BudgetError
from fxopt.planning.checkpoint_search import (
    Predictions,
    _solver_least_memory,
    least_memory_plan,
    plan_key,
    search_plan,
)
from fxopt.planning.solver import block_plan, modelled_bytes, plan_checkpoints


def counting(predict):
    """``predict`` that records the key of every plan it is asked about."""
    asked = []

    def counted(plan):
        asked.append(plan_key(plan))
        return predict(plan)
    return counted, asked


def test_the_least_modelled_plan_is_not_taken_when_another_candidate_predicts_less():
    problem = pre_norm_layers(4)
    least_modelled = plan_key(_solver_least_memory(problem, 16)[0])

    def disagreeing(plan):  # the prediction ranks the model's favourite last
        return modelled_bytes(problem, plan) + (10_000 if plan_key(plan) == least_modelled else 0)

    predict, asked = counting(disagreeing)
    peak, plan = least_memory_plan(problem, predict, 16)
    assert len(asked) == len(set(asked)) >= 3  # several distinct candidates, each predicted once
    assert least_modelled in asked and plan_key(block_plan(problem)) in asked
    assert plan_key(plan) != least_modelled
    candidates = _solver_least_memory(problem, 16) + [block_plan(problem)]
    assert peak == disagreeing(plan) == min(disagreeing(p) for p in candidates)


def test_plans_the_re_solving_rounds_predicted_are_candidates_too():
    problem = pre_norm_layers(4)
    cheap = plan_checkpoints(problem, problem.kept_without_checkpointing() - 1)
    assert cheap is not None and cheap.regions
    predict, asked = counting(lambda plan: 100 if plan_key(plan) == plan_key(cheap) else 1000)
    predictions = Predictions(predict)
    assert predictions(cheap) == 100  # as search_plan's first round would have
    peak, plan = least_memory_plan(problem, predictions, 16)
    assert (peak, plan_key(plan)) == (100, plan_key(cheap))
    assert asked.count(plan_key(cheap)) == 1  # not predicted again


def test_equal_predictions_are_broken_by_recompute_time_then_by_graph_order():
    problem = pre_norm_layers(6)
    peak, plan = least_memory_plan(problem, lambda plan: 5000, 16)
    candidates = _solver_least_memory(problem, 16)[:4] + [block_plan(problem)]
    fastest = min(candidates, key=lambda p: (p.extra_seconds, len(p.regions), plan_key(p)))
    assert peak == 5000 and plan_key(plan) == plan_key(fastest)


def test_search_names_the_least_predicted_peak_of_all_candidates_when_none_fits():
    problem = pre_norm_layers(4)
    predict, asked = counting(lambda plan: 10_000 + modelled_bytes(problem, plan)
                              - 7 * len(plan.regions))
    with pytest.raises(BudgetError) as error:
        search_plan(problem, target=100, unoptimized_peak=20_000, predict=predict)
    assert len(asked) == len(set(asked)) >= 3
    smallest = min(10_000 + modelled_bytes(problem, p) - 7 * len(p.regions) for p in
                   _solver_least_memory(problem, 16)[:4] + [block_plan(problem)])
    assert error.value.smallest_bytes <= smallest
