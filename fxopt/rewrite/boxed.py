"""Free the inputs of a forward early, where the caller lets go of them: ``release_inputs``.

FX's generated code drops every value after its last use -- except the inputs, which the caller
still holds: ``model(x)`` keeps ``x`` alive for the whole call through the argument tuple. With
``release_inputs(gm)`` the caller hands its inputs over in a list, ``boxed([x])``; the forward
takes them out and empties the list (PyTorch's *boxed* calling convention, used by AOTAutograd;
``fxopt.runtime.boxed`` generates the code), so an input is freed right after its last use
inside the forward when nothing else refers to it.

The returned GraphModule shares ``gm``'s module tree (parameters, buffers, submodules: the user's
own) and graph nodes' meta; only the calling convention differs. It saves memory only when the
caller keeps no reference (``boxed([load_batch()])``), and in training only for inputs autograd
does not save (an input fed straight to a convolution with trainable weights is saved anyway).

Not handled: a module whose generated code is not plain torch.fx code -- a forward that depends
on ``self.training`` (``fxopt.graph.train_eval``) or takes pytree-structured arguments -- raises
``ConfigError`` rather than lose its eval-mode path or its argument handling.
"""

from __future__ import annotations

from torch import fx

from fxopt.graph.graphs import graph_module_like
from fxopt.graph.train_eval import has_eval_graph
from fxopt.core.errors import ConfigError
from fxopt.core.torch_private import codegen_of, has_plain_codegen
from fxopt.runtime.boxed import boxed_graph


def release_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with the boxed calling convention: ``boxed(inputs_list)`` empties the list."""
    if not has_plain_codegen(gm.graph):
        why = ("its forward depends on self.training (a graph per mode)" if has_eval_graph(gm)
               else f"its code generator is {type(codegen_of(gm.graph)).__name__}")
        raise ConfigError(f"release_inputs cannot rewrite {type(gm).__name__}: {why}",
                          hint="call the module normally; its inputs are then freed when the "
                          "caller drops them")
    boxed = graph_module_like(gm, boxed_graph(gm.graph))
    boxed.meta.update(gm.meta)
    return boxed
