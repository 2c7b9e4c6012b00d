"""The eval-mode graph a module with a graph per training mode calls when ``training`` is False.

``fxopt.graph.train_eval`` installs, in front of the train-mode graph's generated ``forward``,
``if not self.training: return fxopt_eval_forward(self, ...)``; ``fxopt_eval_forward`` is an
``EvalForward``: the eval-mode graph's code run with the optimized module as ``self``, so both
graphs use the same submodules, parameters and buffers. The eval-mode module is code only
(``fxopt.core.modules.code_only_module``): it holds no tensor of the model, so nothing a script does
to the optimized module's state can leave it behind.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx


class EvalForward:
    """The eval-mode graph as a function of the train-mode GraphModule (same attribute names)."""

    def __init__(self, eval_module: fx.GraphModule):
        self.eval_module = eval_module
        self.function = type(eval_module).forward

    def __call__(self, root: torch.nn.Module, *args: Any) -> Any:
        return self.function(root, *args)

    def __deepcopy__(self, memo: dict) -> EvalForward:
        # Stateless with respect to the module it runs on: a deep copy of the optimized module
        # calls it with the copy as ``root``, so sharing it is correct (and copies no weights).
        return self
