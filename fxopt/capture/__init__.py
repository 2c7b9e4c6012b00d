"""Model -> GraphModule with ``meta["val"]`` on every node.

- ``trace``: symbolic tracing of a structural copy, with the innermost-first leaf fallback.
- ``trace_checks``: what tracing refuses, and the hints its failures carry.
- ``train_eval``: a second trace in eval mode, and one module that dispatches between the two.
- ``meta``: shape/dtype/device metadata propagated on fake tensors.
- ``fake_run``: running a module on fake tensors without touching the user's tensors or RNG.
"""
