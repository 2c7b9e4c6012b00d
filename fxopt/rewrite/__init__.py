"""The pass machinery: contract, pipeline, invariants, graph surgery helpers.

- ``pass_base``: ``PassResult`` (torch.fx's, plus stats) and ``mark_new`` provenance.
- ``registry``: ``PassRegistry``, an explicit, ordered registry of passes.
- ``pipeline``: ``Config`` and the loop that runs passes and checks invariants after each.
- ``invariants``: what every pass must leave (well-formed graph, meta, same parameters).
- ``subgraph``: cutting a run of nodes out as a GraphModule of its own.
- ``boxed``: ``release_inputs``, the boxed calling convention.
"""
