"""What an optimized module calls while it runs.

- ``regions``: ``CheckpointedRegion`` and its graph call site ``call_region`` (activation
  checkpointing with RNG replay, selective recomputation, BatchNorm buffers restored).
- ``eval_forward``: the eval-mode graph a module with a graph per training mode dispatches to.
- ``op_kinds``: which ATen ops count as heavy (kept by selective checkpointing) and which draw
  random numbers; shared with the planners so run time and planning agree.

Every module here imports torch and the standard library only (``tests/test_layers.py`` checks
it): the exporter copies them next to the generated code, where fxopt is not installed.
"""
