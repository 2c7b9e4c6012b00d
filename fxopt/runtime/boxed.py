"""The boxed calling convention: a forward that takes its inputs in a list and empties it.

``model(x)`` keeps ``x`` alive for the whole call through the argument tuple, and torch.fx's code
drops a value only after its last use, which for an input is the call. Code generated from
``boxed_graph(graph)`` is ``forward(self, inputs_list)``: it unpacks the list into its locals
and empties it, so an input the caller handed over (and holds no other reference to) is freed
right after its last use inside the forward: PyTorch's own convention for AOTAutograd's
compiled functions, written here with torch.fx's public ``CodeGen`` so that the runtime (which
export copies where fxopt is not installed) can generate it too.

Used by checkpointed regions without grad (``fxopt.runtime.regions``) and by
``fxopt.rewrite.boxed.release_inputs``.
"""

from __future__ import annotations

from typing import Any

from torch import fx


class BoxedCode(fx.CodeGen):
    """``forward(self, <list>)``: unpacks its inputs from the list and empties it. The list's
    name is one no graph value takes (a model's own input may well be called ``inputs``)."""

    LIST = "_fxopt_boxed_inputs"

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **_: Any) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        unpack = f"\n    {', '.join(names)}, = {self.LIST}" if names else ""
        return (f"def forward(self, {self.LIST}){maybe_return_annotation}:{unpack}"
                f"\n    {self.LIST}.clear()")


def boxed_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose generated code takes its inputs as one list and empties it."""
    boxed = fx.Graph()
    boxed.output(boxed.graph_copy(graph, {}))
    boxed.set_codegen(BoxedCode())
    return boxed
