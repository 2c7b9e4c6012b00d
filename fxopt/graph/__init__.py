"""The graph layer: what every analysis, plan and pass reads a captured module through.

Between ``core`` and the capture frontends (``fxopt.capture``: symbolic tracing, torch.export,
leaves), it owns:

- ``graphs``: ``graphs_of(module)``, the one walk over a module's graphs (train, eval, region
  bodies, blocks), and ``graph_module_like``;
- ``fake_run``: running a module on fake tensors without touching the user's state;
- ``meta``: ``node.meta["val"]`` propagation on fakes;
- ``train_eval``: a module with a graph per training mode;
- ``pickling``: ``torch.save`` of a capture, refused where torch.fx's pickling would lose part of it;
- ``leaf_tape``: opaque leaves' recorded real runs, replayed on fakes.
"""
