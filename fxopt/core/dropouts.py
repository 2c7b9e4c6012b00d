"""The dropouts, in every spelling a graph records them: one table for the analyses that ask
whether a node draws random numbers and the graph comparisons that ask whether it drops anything.

- ``TORCH_DROPOUTS`` and ``ATEN_DROPOUTS``: called ``(input, p, train)``: torch's namespace
  functions (``torch.dropout``, what symbolic tracing records for them) and ATen's operators
  (what torch.export records), in-place spellings included; ``POSITIONAL_DROPOUTS`` is both.
- ``FUNCTIONAL_DROPOUTS``: ``torch.nn.functional``'s, called ``(input, p, training, inplace)``.
- ``DROPOUT_MODULES``: the ``nn`` modules that call them.

``drops_nothing(node)`` reads the table: whether a graph's dropout call gives back its input
(p 0, or training off).

``aten.native_dropout`` is not here: it returns the mask beside the output, so it never gives its
input back. The random-number analysis lists it with the other samplers.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import fx, nn

_aten = torch.ops.aten

TORCH_DROPOUTS = frozenset({
    torch.dropout, torch.dropout_, torch.feature_dropout, torch.feature_dropout_,
    torch.alpha_dropout, torch.alpha_dropout_, torch.feature_alpha_dropout,
    torch.feature_alpha_dropout_,
})

ATEN_DROPOUTS = frozenset({
    _aten.dropout.default, _aten.dropout_.default, _aten.feature_dropout.default,
    _aten.feature_dropout_.default, _aten.alpha_dropout.default, _aten.alpha_dropout_.default,
    _aten.feature_alpha_dropout.default, _aten.feature_alpha_dropout_.default,
})

POSITIONAL_DROPOUTS = TORCH_DROPOUTS | ATEN_DROPOUTS

FUNCTIONAL_DROPOUTS = frozenset({
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
})

DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout)


def drops_nothing(node: fx.Node) -> bool:
    """Whether ``node`` is a dropout that gives back its input's values: p 0 or training off.

    ATen's dropouts then return the input itself without drawing a random number, in either
    training mode, so ``nn.Dropout(0.0)`` traced in train mode (``dropout(x, 0.0, True)``) and
    in eval mode (``dropout(x, 0.0, False)``) is one computation."""
    if node.op != "call_function":
        return False
    if node.target in POSITIONAL_DROPOUTS:
        if len(node.args) != 3 or node.kwargs:
            return False
        p, train = node.args[1:]
    elif node.target in FUNCTIONAL_DROPOUTS:
        try:
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        p, train = bound.arguments["p"], bound.arguments["training"]
    else:
        return False
    return (isinstance(p, (int, float)) and p == 0) or train is False
