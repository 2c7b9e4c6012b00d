"""Decisions, no graph edits: what the passes apply.

- ``budget``: memory budgets as users write them, and the activation memory a fraction refers to.
- ``checkpoint_problem``: a traced graph as the solver's abstract ``CheckpointProblem``.
- ``solver``: the dynamic program that picks checkpointed regions under a budget.
- ``checkpoint_search``: the search around the solver (re-solve rounds, bisections) that checks
  each plan against ``estimate_peak``.
- ``schedule``: legal orders of a graph and candidate memory-aware schedules.
- ``pad_plan`` / ``pad_policy``: which ops to pad, where padding flows, and when it pays.
- ``inplace``: which activation call sites may overwrite their input (``inplace_activations``).
- ``causal_mask``: which masked attention calls are provably causal (``causal_attention``).
"""
