"""What an optimized module calls while it runs.

- ``regions``: ``CheckpointedRegion`` and its graph call site ``call_region`` (activation
  checkpointing over a recompute graph built at optimize time: selective regions keep the
  outputs the plan names, BatchNorm is recomputed without touching its buffers, dropout by RNG
  replay), and ``HEAVY_ATEN_OPS``: the ops whose nodes the planner's cost model calls heavy
  (kept by a selective region), and which SAC keeps under ``torch.compile``.
- ``boxed``: code generated with the boxed calling convention (a forward that takes its inputs
  in a list and empties it), which a region runs without grad (``region_inputs`` hands its
  inputs over) and ``fxopt.rewrite.boxed.release_inputs`` gives a whole module.
- ``region_frame``: what a region runs in a training step: saved-tensor hooks that save nothing
  and the recomputation that fills them in backward.
- ``eval_forward``: the eval-mode graph a module with a graph per training mode dispatches to.
- ``input_guard``: the first node of a graph captured by torch.export, which refuses inputs
  outside what export captured (a size it specialised, another dtype or structure).
- ``devices``: where an export-captured graph's factory ops make their tensors, read from a
  parameter or input when it runs (``tensor_device``), and lifted constants moved there.
- ``fused_step`` and ``fuse``: the optimizer step fused into backward (``FusedOptimizer``, and
  ``fuse_optimizer``, its public factory), which the user's training loop runs.
- ``chunked_loss`` and ``embedding_rows``: a language model's head and loss over chunks of
  tokens, and an embedding lookup; both hand their vocabulary-sized weight gradient to a fused
  step in rows (``FusedOptimizer.defer_gradient_rows``) where one takes it.
- ``chunked_mlp``: a transformer block's MLP over chunks of tokens, saving only its input and
  recomputing each chunk's projections in backward.
- ``errors``: every error fxopt raises (``fxopt.core.errors`` re-exports them), so the code
  above raises them itself.

Every module here imports torch, the standard library and its siblings (relatively: ``from
.errors import InputError``) only (``tests/test_layers.py`` checks it): the exporter copies the
ones a graph calls next to the generated code, where fxopt is not installed.
"""
