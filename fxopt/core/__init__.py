"""What every layer shares.

- ``errors``: every error a user can hit (``FxoptError`` and its subclasses).
- ``inputs``: what fxopt accepts as example inputs.
- ``state``: snapshot and restore of everything a training step changes.
- ``step``: the one definition of a training step.
- ``tensors``: bytes of a value or storage, storage identity, the device of a graph.
- ``modules``: structural copies of module trees, hooks, state swaps.
- ``dropouts``: the dropout operators in every spelling a graph records.
- ``torch_private``: the one home of every private torch API fxopt relies on.
"""
