"""What an optimized module calls while it runs.

- ``regions``: ``CheckpointedRegion`` and its graph call site ``call_region`` (activation
  checkpointing with RNG replay, selective recomputation, BatchNorm buffers shielded from recomputation), and
  ``HEAVY_ATEN_OPS``: the ops selective recomputation keeps, which the planner's cost model
  calls heavy too (one definition, so plan and run time agree).
- ``eval_forward``: the eval-mode graph a module with a graph per training mode dispatches to.
- ``input_guard``: the first node of a graph captured by torch.export, which refuses inputs
  outside what export captured (a size it specialised, another dtype or structure).

Every module here imports torch and the standard library only (``tests/test_layers.py`` checks
it): the exporter copies them next to the generated code, where fxopt is not installed.
"""
