"""Original vs fxopt vs peers, measured side by side in one run (``fxopt bench``).

- ``runs``: ``bench`` and its table.
- ``peers``: ``checkpoint_sequential`` and torch.compile's min-cut budget, built as their users
  would build them.
"""

from fxopt.bench.runs import DEFAULT_PEERS, bench, format_table

__all__ = ["DEFAULT_PEERS", "bench", "format_table"]
