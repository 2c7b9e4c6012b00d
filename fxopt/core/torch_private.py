"""Every private torch API fxopt relies on, in one place, so a torch upgrade breaks here.

fxopt needs a few things torch has no public API for: fake tensors, dispatch modes, pytrees,
swapping a module's tensors for others, a graph's code generator, a storage's identity, RNN weight
caches, the torch.compile knobs its benchmarks compare against. Everything else in fxopt imports
them from here (``tests/test_torch_private.py`` checks that nothing else reaches into a private
torch module or attribute, and that each name below still exists in the installed torch).

nn.Module's own per-instance containers (``_parameters``, ``_modules``, hook dicts) are the one
exception: ``fxopt.core.modules`` reads them, and derives their list from a fresh ``nn.Module()``.
Checked against torch 2.14.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

# Fake tensors and dispatch modes.
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.graph import CodeGen, _BoxedCodeGen
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.nn.modules.dropout import _DropoutNd as DropoutBase
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Pytrees: torch 2.14 has no public pytree module.
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_map_only,
    tree_structure,
    tree_unflatten,
)

_FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def written_arguments(target: Any) -> tuple[tuple[int, str], ...] | None:
    """(position, name) of every argument an ATen operator writes in place (``Tensor(a!)`` in its
    schema: ``aten.relu_``'s self, ``aten.add.out``'s out), or None when ``target`` is not an
    ATen operator overload."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return tuple((index, argument.name) for index, argument in enumerate(target._schema.arguments)
                 if argument.alias_info is not None and argument.alias_info.is_write)


def disable_current_modes() -> contextlib.AbstractContextManager:
    """Run real kernels inside a fake-tensor or dispatch mode."""
    return _disable_current_modes()


def reparametrize_module(module: nn.Module, state: dict[str, torch.Tensor]
                         ) -> contextlib.AbstractContextManager:
    """``module`` computes with ``state``'s tensors (by qualified name) inside; tied weights stay
    tied. ``torch.func.functional_call`` does the same for one call; fxopt needs a scope."""
    return _reparametrize_module(module, state, tie_weights=True)


def tensor_metadata(t: torch.Tensor) -> Any:
    """torch.fx's ``TensorMetadata`` of ``t`` (``node.meta["tensor_meta"]``, as ShapeProp sets)."""
    return _extract_tensor_metadata(t)


def codegen_of(graph: fx.Graph) -> CodeGen:
    """The code generator a graph's ``python_code`` uses (plain, pytree, fxopt's mode dispatch)."""
    return graph._codegen


def has_plain_codegen(graph: fx.Graph) -> bool:
    return type(graph._codegen) is CodeGen


def copy_codegen(source: fx.Graph, target: fx.Graph) -> None:
    """Give ``target`` the code generator of ``source`` (its argument handling, mode dispatch)."""
    target._codegen = source._codegen


def boxed_codegen() -> CodeGen:
    """The boxed calling convention's code generator: ``forward(args_list)`` empties the list."""
    return _BoxedCodeGen()


def storage_id(storage: torch.UntypedStorage) -> int:
    """An id of the storage itself, equal for every tensor (and view) on it while it is alive.
    ``id(t.untyped_storage())`` is not: each call makes a new Python object."""
    return storage._cdata


def keeps_rnn_weight_cache(module: nn.Module) -> bool:
    """Whether ``module`` caches a flat list of its weights (nn.RNN, LSTM, GRU) that must be
    rebuilt whenever its parameters are replaced."""
    return callable(getattr(module, "_init_flat_weights", None))


def rebuild_rnn_weights(module: nn.Module) -> bool:
    """Make an RNN rebuild its cached flat weight list after its parameters were swapped;
    False for modules that keep no such cache."""
    if not keeps_rnn_weight_cache(module):
        return False
    module._init_flat_weights()
    return True


RNN_WEIGHT_CACHES = frozenset({"_flat_weights", "_flat_weight_refs"})
# aten.mkldnn_rnn_layer returns (output, hy, cy, workspace): the workspace is index 3.
MKLDNN_RNN_WORKSPACE_INDEX = 3


@contextlib.contextmanager
def quiet_fake_tensor_logs() -> Iterator[None]:
    """FakeTensorMode logs a full traceback for every failing kernel before raising; fxopt's own
    error says what failed. Quiet inside this scope only; the logger's level is restored."""
    logger = logging.getLogger(_FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def min_cut_memory_budget(fraction: float) -> contextlib.AbstractContextManager:
    """torch.compile's min-cut partitioner keeps at most ``fraction`` of activation memory
    (``torch._functorch.config.activation_memory_budget``) for what is compiled inside."""
    from torch._functorch import config as functorch_config

    return functorch_config.patch(activation_memory_budget=fraction)


def recompiles_unlimited() -> contextlib.AbstractContextManager:
    """Inside, dynamo compiles a code object anew as often as asked. By default it keeps at most
    ``recompile_limit`` (8) compiled versions per code object and then runs it eager, silently
    but for a warning: a benchmark comparing several compile budgets on one model class would
    measure eager steps from the ninth on."""
    from torch._dynamo import config as dynamo_config

    return dynamo_config.patch(recompile_limit=2**16, accumulated_recompile_limit=2**16)


def compile_backend(name: str) -> Any:
    """The torch.compile backend registered as ``name``."""
    from torch._dynamo import lookup_backend

    return lookup_backend(name)

__all__ = [
    "BatchNormBase",
    "CodeGen",
    "DropoutBase",
    "FakeTensor",
    "FakeTensorMode",
    "MKLDNN_RNN_WORKSPACE_INDEX",
    "RNN_WEIGHT_CACHES",
    "TorchDispatchMode",
    "TreeSpec",
    "boxed_codegen",
    "codegen_of",
    "compile_backend",
    "recompiles_unlimited",
    "copy_codegen",
    "disable_current_modes",
    "fx",
    "has_plain_codegen",
    "keeps_rnn_weight_cache",
    "keystr",
    "min_cut_memory_budget",
    "nn",
    "quiet_fake_tensor_logs",
    "rebuild_rnn_weights",
    "reparametrize_module",
    "storage_id",
    "tensor_metadata",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "tree_structure",
    "tree_unflatten",
    "unset_fake_temporarily",
    "written_arguments",
]


def size_oblivious_export() -> contextlib.AbstractContextManager:
    """Inside, torch.export leaves an example size of 0 or 1 symbolic and records every decision
    forward takes on a size being 0 or 1 as a guard, instead of assuming sizes of at least 2
    (``torch.fx.experimental._config.backed_size_oblivious``, experimental in torch 2.14)."""
    from torch.fx.experimental import _config as shapes_config

    return shapes_config.patch(backed_size_oblivious=True)


def export_guards(program: Any) -> list[str] | None:
    """The conditions on input sizes an ``ExportedProgram`` was traced under, as Python source
    over ``L['<forward argument>'][<index>].size()[<dim>]`` (``program._guards_code``: what
    ``program.module()`` asserts), or None when this torch keeps no such list."""
    guards = getattr(program, "_guards_code", None)
    return None if guards is None else [str(g) for g in guards]


# What ``torch.no_grad()`` records as when a graph calls it bare (export's training IR wraps it in
# ``torch.ops.higher_order.wrap_with_set_grad_enabled`` instead; fxopt.capture.exception_safe).
BARE_SET_GRAD_ENABLED = torch._C._set_grad_enabled
