"""Shape/dtype/device/stride metadata on every node, computed on fake tensors.

``propagate_meta(gm, example_inputs)`` interprets the graph under ``FakeTensorMode`` with the
module's parameters and buffers swapped for fake copies, and stores each node's result in
``node.meta["val"]`` (a FakeTensor, or a pytree of them). No real compute happens, so this costs
nothing on a model too large for the machine, and the real BatchNorm running statistics and the
global RNG are never touched.

A leaf module whose forward cannot run on fake tensors (it reads tensor values, e.g. ``if
x.sum() > 0``) is run once for real on a deep copy, with random inputs of the right shape, under a
forked RNG; its outputs are converted back to fake tensors and the node is marked
``meta["fxopt_meta_source"] = "real"``. Output shapes that depend on input *values* are then only
as good as that one sample -- until capture records the leaf's real run on the example inputs
(``fxopt.capture.leaf_recording``): from then on the leaf replays that record on fakes
(``fxopt.graph.leaf_tape``), or, where the replay fails, gets the recorded outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fxopt.graph.fake_run import fake_copy, reparametrized
from fxopt.graph.leaf_tape import leaves_replayed, recorded_outputs
from fxopt.graph.graphs import graphs_of
from fxopt.core import meta_keys
from fxopt.core.graphs import placeholder_values
from fxopt.core.state import preserved_rng
from fxopt.core.tensors import random_like
from fxopt.core.torch_private import (
    FakeTensor,
    FakeTensorMode,
    quiet_fake_tensor_logs,
    tensor_metadata,
    tree_map_only,
    unset_fake_temporarily,
)


class _FakeInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, real_state: dict[str, torch.Tensor],
                 around_node: Callable[[fx.Node], contextlib.AbstractContextManager] | None = None):
        super().__init__(gm)
        self.mode = mode
        self.real_state = real_state
        self.around_node = around_node
        self.node: fx.Node | None = None

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(target, args, kwargs)
        except Exception:
            return self._run_for_real(target, args, kwargs)

    def _run_for_real(self, target: str, args: Any, kwargs: Any) -> Any:
        """Run one leaf for real on cloned state and random inputs; return fake outputs (the
        outputs of the leaf's recorded real run, when it has one that its replay failed)."""
        assert self.node is not None
        self.node.meta[meta_keys.META_SOURCE] = meta_keys.REAL
        recorded = recorded_outputs(self.node, self.fetch_attr(target), args, kwargs)
        if recorded is not None:
            return recorded
        prefix = target + "."
        with unset_fake_temporarily(), preserved_rng(), torch.no_grad():
            state = {name[len(prefix):]: t.detach().clone()
                     for name, t in self.real_state.items() if name.startswith(prefix)}
            real_args, real_kwargs = tree_map_only(torch.Tensor, random_like, (args, kwargs))
            out = torch.func.functional_call(self.fetch_attr(target), state, real_args, real_kwargs)
        return tree_map_only(torch.Tensor, self.mode.from_tensor, out)

    def _as_fake(self, t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, FakeTensor) else self.mode.from_tensor(t)

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        try:
            with self.around_node(n) if self.around_node else contextlib.nullcontext():
                result = super().run_node(n)
        except Exception as error:
            if not hasattr(error, "_fxopt_node"):
                error._fxopt_node = n  # type: ignore[attr-defined]  # for fxopt.trace's message
            raise
        if n.op == "get_attr":  # tracer constants are real tensors; keep meta fake throughout
            result = tree_map_only(torch.Tensor, self._as_fake, result)
        if n.op != "output":
            # The graph keeps values without autograd history (see drop_autograd_history); the
            # run itself goes on with ``result`` so requires_grad propagates as in training.
            n.meta["val"] = tree_map_only(torch.Tensor, _without_history, result)
            if isinstance(result, torch.Tensor):
                n.meta["tensor_meta"] = tensor_metadata(result)
        return result


def propagate_meta(gm: fx.GraphModule, example_inputs: tuple, *,
                   around_node: Callable[[fx.Node], contextlib.AbstractContextManager] | None = None
                   ) -> None:
    """Set ``meta["val"]`` (and ``meta["tensor_meta"]``) on every non-output node of ``gm``.

    ``around_node(node)``, if given, is a context manager entered around each node's fake
    execution (e.g. a FLOP counter).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = tree_map_only(torch.Tensor, lambda a: fake_copy(a, mode), tuple(example_inputs))
    real_state = dict(gm.named_parameters(remove_duplicate=False))
    real_state.update(gm.named_buffers(remove_duplicate=False))
    fake_state = {name: mode.from_tensor(t) for name, t in real_state.items()}
    with preserved_rng(), reparametrized(gm, fake_state), mode, quiet_fake_tensor_logs(), \
            leaves_replayed(gm):
        _FakeInterpreter(gm, mode, real_state, around_node).run(*fake_inputs)


def refresh_meta(gm: fx.GraphModule) -> None:
    """Recompute ``meta["val"]`` on every node after a rewrite, from the placeholders' meta.

    Fake inputs of an earlier FakeTensorMode are rebuilt as fresh empty tensors of the same
    shape, stride, dtype and device (values never matter to fake propagation).
    """
    propagate_meta(gm, placeholder_values(gm))


def drop_autograd_history(gm: fx.GraphModule) -> None:
    """Cut the autograd graphs of fake propagation out of ``meta["val"]`` in every graph of
    ``gm`` (its blocks, eval-mode graphs, region and scope bodies), keeping shape, dtype,
    strides and ``requires_grad``.

    A fake run through a checkpointed region records torch.utils.checkpoint's recomputation
    closure, which holds a real copy of the RNG state (5 KiB on CPU, more with CUDA
    generators): kept in the metadata it stays resident as long as the module lives. Worse, the
    closure holds the region, whose body's metadata names nodes of the graph that holds the
    history: a cycle through autograd's C++ nodes that Python's garbage collector cannot see,
    so a graph a later pass replaces, and the module it belongs to (FSDP2's hooks link every
    sharded module to the root), would never be freed. ``propagate_meta`` therefore stores
    values without history in the first place; this catches any other writer. Analyses that
    need views and histories run the graph again on fakes.
    """
    seen: set[int] = set()
    for graph in (found.graph for found in graphs_of(gm)):
        if id(graph) in seen:
            continue
        seen.add(id(graph))
        for node in graph.nodes:
            if "val" in node.meta:
                node.meta["val"] = tree_map_only(torch.Tensor, _without_history, node.meta["val"])


def _without_history(value: torch.Tensor) -> torch.Tensor:
    if value.grad_fn is None:
        return value
    with value.fake_mode if hasattr(value, "fake_mode") else contextlib.nullcontext():
        return value.detach().requires_grad_(value.requires_grad)
