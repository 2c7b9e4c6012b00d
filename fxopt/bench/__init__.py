"""Original vs fxopt vs peers, measured side by side in one run (``fxopt bench``).

- ``runs``: ``bench`` and its table.
- ``spread``: step times of several models alternated in one run, with fastest, median and
  slowest, and whether a change between two is within the run's noise.
- ``before_after``: the before/after table of ``fxopt optimize`` (peaks and step-time spread).
- ``peers``: ``checkpoint_sequential`` and torch.compile's min-cut budget, built as their users
  would build them.
"""

from fxopt.bench.runs import DEFAULT_PEERS, bench, format_table

__all__ = ["DEFAULT_PEERS", "bench", "format_table"]
