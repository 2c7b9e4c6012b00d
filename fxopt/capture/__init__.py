"""Model -> GraphModule with ``meta["val"]`` on every node.

- ``chain``: which frontend captures a model (``capture(model, args, capture="auto")``).
- ``trace``: symbolic tracing of a structural copy, with the innermost-first leaf fallback.
- ``export_frontend``: torch.export as a frontend, unlifted to a plain GraphModule; with
  ``export_signature`` (the example call bound to forward's signature) and ``recipes`` (nested
  inputs and outputs, rebuilt in the graph). Its input guard is ``fxopt.runtime.input_guard``.
- ``trace_checks``: what tracing refuses, and the hints its failures carry.
- ``train_eval``: a second trace in eval mode, and one module that dispatches between the two.
- ``meta``: shape/dtype/device metadata propagated on fake tensors.
- ``fake_run``: running a module on fake tensors without touching the user's tensors or RNG.
"""
