"""What an optimized module calls while it runs.

- ``regions``: ``CheckpointedRegion`` and its graph call site ``call_region`` (activation
  checkpointing with RNG replay, selective recomputation, BatchNorm buffers shielded from recomputation), and
  ``HEAVY_ATEN_OPS``: the ops selective recomputation keeps, which the planner's cost model
  calls heavy too (one definition, so plan and run time agree).
- ``eval_forward``: the eval-mode graph a module with a graph per training mode dispatches to.
- ``input_guard``: the first node of a graph captured by torch.export, which refuses inputs
  outside what export captured (a size it specialised, another dtype or structure).
- ``devices``: where an export-captured graph's factory ops make their tensors, read from a
  parameter or input when it runs (``tensor_device``), and lifted constants moved there.
- ``fused_step`` and ``fuse``: the optimizer step fused into backward (``FusedOptimizer``, and
  ``fuse_optimizer``, its public factory), which the user's training loop runs.
- ``errors``: every error fxopt raises (``fxopt.core.errors`` re-exports them), so the code
  above raises them itself.

Every module here imports torch, the standard library and its siblings (relatively: ``from
.errors import InputError``) only (``tests/test_layers.py`` checks it): the exporter copies the
ones a graph calls next to the generated code, where fxopt is not installed.
"""
