"""Every private torch API fxopt relies on, in one place, so a torch upgrade breaks here.

fxopt needs a few things torch has no public API for: fake tensors, dispatch modes, pytrees,
swapping a module's tensors for others, a graph's code generator, a storage's identity, RNN weight
caches, the torch.compile knobs its benchmarks compare against. Everything else in fxopt imports
them from here (``tests/test_torch_private.py`` checks that nothing else reaches into a private
torch module or attribute, and that each name below still exists in the installed torch).

nn.Module's own per-instance containers (``_parameters``, ``_modules``, hook dicts) are the one
exception: ``fxopt.core.modules`` reads them, and derives their list from a fresh ``nn.Module()``.
Private names spelled as strings (attribute names for ``getattr``, code that export writes) count
too: the scan reads string literals. ``fxopt.runtime`` cannot import this module (export copies it
where fxopt is not installed); the few private ATen op names it needs are looked up by name there,
and checked by the same test. Checked against torch 2.14.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

# Fake tensors and dispatch modes.
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.graph import CodeGen
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.multiprocessing.reductions import StorageWeakRef  # undocumented, on a public path
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.nn.modules.batchnorm import _NormBase as NormBase  # BatchNorm's and InstanceNorm's
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


def argument_defaults(target: Any) -> tuple[list[str], dict[str, Any]] | None:
    """The argument names of an ATen operator overload in order, and the defaults of those that
    have one (from its schema), or None when ``target`` is not one."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    arguments = target._schema.arguments
    return ([a.name for a in arguments],
            {a.name: a.default_value for a in arguments if a.has_default_value()})


def tracer_class(gm: Any) -> type | None:
    """The tracer class torch.fx re-traces ``gm``'s code with when it is unpickled (None: fx's
    own ``Tracer``)."""
    return gm._tracer_cls


def set_tracer_class(gm: Any, tracer: type) -> None:
    """Have torch.fx re-trace ``gm``'s code with ``tracer`` when it is unpickled; its graph
    carries the class too, which is where ``GraphModule.__init__`` (so a deep copy) takes it
    from."""
    gm._tracer_cls = tracer
    gm.graph._tracer_cls = tracer


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter: it grows with every in-place write to its storage."""
    return t._version


aten = torch.ops.aten
# ATen operators with a leading underscore (no public promise) that graphs hold and fxopt's
# recognisers match; looked up by name so a torch without one still imports fxopt.
_PRIVATE_OP_NAMES = ("_assert_tensor_metadata", "_unsafe_view", "_to_copy", "_log_softmax")


def _overloads(name: str, overload: str = "default") -> frozenset:
    packet = getattr(aten, name, None)
    found = getattr(packet, overload, None) if packet is not None else None
    return frozenset({found} if found is not None else ())


ASSERT_TENSOR_METADATA = _overloads("_assert_tensor_metadata")
UNSAFE_VIEW = _overloads("_unsafe_view")
TO_COPY = _overloads("_to_copy")
LOG_SOFTMAX_PRIVATE = _overloads("_log_softmax")


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


def forward_pre_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward pre-hooks registered on ``module`` (``_forward_pre_hooks``), in order."""
    return list(module._forward_pre_hooks.values())


def codegen_of(graph: fx.Graph) -> CodeGen:
    """The code generator a graph's ``python_code`` uses (plain, pytree, fxopt's mode dispatch)."""
    return graph._codegen


def has_plain_codegen(graph: fx.Graph) -> bool:
    return type(graph._codegen) is CodeGen


def copy_codegen(source: fx.Graph, target: fx.Graph) -> None:
    """Give ``target`` the code generator of ``source`` (its argument handling, mode dispatch)."""
    target._codegen = source._codegen


def without_call_wrapper(cls: type) -> type:
    """A copy of a GraphModule's per-instance class without the call wrapper ``recompile()``
    installs on it (``_wrapped_call`` and the ``__call__`` that reads ``self._wrapped_call``): a
    class derived from it gets a wrapper of its own at its first recompile, whose ``super()``
    call must not reach another wrapper (each would call the other)."""
    members = {k: v for k, v in vars(cls).items()
               if k not in ("__dict__", "__weakref__", "_wrapped_call", "__call__")}
    copied = type(cls.__name__, cls.__bases__, members)
    copied.__qualname__ = cls.__qualname__  # still a per-instance class
    return copied


def per_instance_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that torch.fx (``GraphModule.__new__``) or fxopt
    (``derive_instance_class``) made for one GraphModule: named GraphModuleImpl, as
    ``GraphModule.__new__`` recognizes them."""
    return [c for c in cls.__mro__ if "GraphModuleImpl" in c.__qualname__]


def derive_instance_class(gm: Any, interface: type) -> None:
    """Make ``gm``'s class one of its own deriving from ``interface`` (a GraphModule subclass
    adding methods: a Hugging Face model's interface, a Sequential's indexing) and from its
    present per-instance class, whose name it keeps. Named like torch.fx's per-instance classes,
    so that a copy's class derives from ``interface`` (``GraphModule.__new__`` skips classes of
    that name); over the class less its call wrapper, since ``recompile()`` makes the new
    class's own."""
    base = type(gm)
    gm.__class__ = type("GraphModuleImpl", (interface, without_call_wrapper(base)), {})
    gm.__class__.__name__ = base.__name__
    gm.recompile()


# What fx keeps on a GraphModule to hold and run its graph: the graph, and what fx derives from
# it (the generated code, its line map, the tracer that made it).
_GRAPH_MODULE_INTERNALS = frozenset({"graph", "_graph", "_code", "_lineno_map", "_prologue_start",
                                     "_tracer_cls", "_tracer_extras"})


def graph_module_attributes(gm: fx.GraphModule) -> dict[str, Any]:
    """``gm``'s instance attributes but its graph and what fx derives from it (its code, line
    map, tracer): its submodules, parameters, buffers, hooks and whatever else was set on it."""
    return {k: v for k, v in vars(gm).items() if k not in _GRAPH_MODULE_INTERNALS}


# What fx puts on a GraphModule's per-instance class: its generated forward (described by the
# module's code) and the call wrapper around it, the same for every GraphModule.
_GRAPH_MODULE_CLASS_INTERNALS = frozenset({"forward", "_wrapped_call", "__call__", "__dict__",
                                           "__weakref__", "__module__", "__doc__",
                                           "__qualname__"})


def graph_module_class_members(cls: type) -> dict[str, Any]:
    """The members of a GraphModule's per-instance class but what fx itself puts there (the
    generated ``forward`` and its call wrapper): what fxopt or a user added to the class."""
    return {k: v for k, v in vars(cls).items() if k not in _GRAPH_MODULE_CLASS_INTERNALS}


def storage_id(storage: torch.UntypedStorage) -> int:
    """An id of the storage itself, equal for every tensor (and view) on it while it is alive.
    ``id(t.untyped_storage())`` is not: each call makes a new Python object."""
    return storage._cdata


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``t._base``), or None when it owns its storage's view."""
    return t._base


# The RNN method that rebuilds the cached flat weight list from the parameters; exported code
# calls it by this name after loading weights (``fxopt.export.module_tree``).
RNN_WEIGHT_REBUILD = "_init_flat_weights"


def keeps_rnn_weight_cache(module: nn.Module) -> bool:
    """Whether ``module`` caches a flat list of its weights (nn.RNN, LSTM, GRU) that must be
    rebuilt whenever its parameters are replaced."""
    return callable(getattr(module, RNN_WEIGHT_REBUILD, None))


def rebuild_rnn_weights(module: nn.Module) -> bool:
    """Make an RNN rebuild its cached flat weight list after its parameters were swapped;
    False for modules that keep no such cache."""
    if not keeps_rnn_weight_cache(module):
        return False
    getattr(module, RNN_WEIGHT_REBUILD)()
    return True


RNN_WEIGHT_CACHES = frozenset({"_flat_weights", "_flat_weight_refs"})
# Per-instance containers of a GraphModule besides its graph and ``meta``: a structural copy
# copies them (``fxopt.core.modules.structural_copy``).
GRAPH_MODULE_CONTAINERS = ("_lineno_map", "_tracer_extras", "_replace_hooks",
                           "_create_node_hooks", "_erase_node_hooks", "_deepcopy_hooks")
# What ``module.compile()`` sets on the instance (a structural copy leaves it out).
COMPILED_CALL = "_compiled_call_impl"
# The method nn.Module's repr asks for a module's name (Hugging Face's Trainer asks it too).
MODULE_NAME_METHOD = "_get_name"
# Whether the legacy ``register_backward_hook`` or a full backward hook is registered.
FULL_BACKWARD_HOOK_FLAG = "_is_full_backward_hook"
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


def compiled_modules(module: nn.Module) -> list[str]:
    """Paths (``""`` for ``module`` itself) of the modules in ``module``'s tree that run code
    compiled by ``torch.compile``: a wrapper ``torch.compile(m)`` returned
    (``torch._dynamo.eval_frame.OptimizedModule``), or a module ``m.compile()`` was called on
    (``COMPILED_CALL`` set), or a module holding such a wrapper as a plain attribute rather
    than a submodule (``fxopt.bench.peers``' compiled peer keeps it out of its state dict). A
    function compiled and called inside ``forward`` is not seen."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [name for name, m in module.named_modules()
            if isinstance(m, OptimizedModule) or getattr(m, COMPILED_CALL, None) is not None
            or any(isinstance(v, OptimizedModule) for v in vars(m).values())]


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper compiles (whose ``forward`` has the
    signature to bind arguments to), or ``module`` itself when it is no such wrapper."""
    from torch._dynamo.eval_frame import OptimizedModule

    return module._orig_mod if isinstance(module, OptimizedModule) else module


# Whether the storage a ``StorageWeakRef.cdata`` points at is freed: what
# ``StorageWeakRef.expired`` calls, without its Python frame (a memory tracker asks it of every
# live storage, often).
storage_expired = torch.Storage._expired


__all__ = [
    "BatchNormBase",
    "COMPILED_CALL",
    "CodeGen",
    "DropoutBase",
    "FULL_BACKWARD_HOOK_FLAG",
    "MODULE_NAME_METHOD",
    "GRAPH_MODULE_CONTAINERS",
    "RNN_WEIGHT_REBUILD",
    "StorageWeakRef",
    "storage_expired",
    "checkpoint_calls_refused",
    "view_base",
    "FakeTensor",
    "FakeTensorMode",
    "MKLDNN_RNN_WORKSPACE_INDEX",
    "RNN_WEIGHT_CACHES",
    "TorchDispatchMode",
    "TreeSpec",
    "codegen_of",
    "compile_backend",
    "compiled_modules",
    "recompiles_unlimited",
    "copy_codegen",
    "disable_current_modes",
    "fx",
    "graph_module_attributes",
    "graph_module_class_members",
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
    "uncompiled",
    "unset_fake_temporarily",
    "without_call_wrapper",
    "derive_instance_class",
    "per_instance_classes",
    "written_arguments",
    "argument_defaults",
    "tensor_version",
    "ASSERT_TENSOR_METADATA",
    "UNSAFE_VIEW",
    "TO_COPY",
    "LOG_SOFTMAX_PRIVATE",
]


def size_oblivious_export() -> contextlib.AbstractContextManager:
    """Inside, torch.export leaves an example size of 0 or 1 symbolic and records every decision
    forward takes on a size being 0 or 1 as a guard, instead of assuming sizes of at least 2
    (``torch.fx.experimental._config.backed_size_oblivious``, experimental in torch 2.14)."""
    from torch.fx.experimental import _config as shapes_config

    return shapes_config.patch(backed_size_oblivious=True)


def fake_tensor_cache_off() -> contextlib.AbstractContextManager:
    """Inside, FakeTensor dispatches without its operator cache
    (``torch._dynamo.config.fake_tensor_cache_enabled``). Under torch.export's symbolic sizes a
    cache hit rebuilds its output's sizes and strides by SymInt arithmetic, which can cost more
    than the dispatch it saves: fxopt's capture of a random-init Hugging Face Llama took a
    median 5.74 s with the cache and 4.25 s without (2 layers of width 64), 18.7 s and 16.2 s
    (12 layers), 6.20 s and 5.44 s (4 layers of width 512); a 6-layer GPT-2 10.72 s and 10.90 s
    (one thread of an AMD EPYC CPU, the settings alternated in one process, 2026-11-29). The
    graph is the same op for op; only the names of a few nodes differ. Fake runs at static
    sizes (fxopt's predictions) keep the cache, where it is 2-4 times faster."""
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(fake_tensor_cache_enabled=False)


def export_guards(program: Any) -> list[str] | None:
    """The conditions on input sizes an ``ExportedProgram`` was traced under, as Python source
    over ``L['<forward argument>'][<index>].size()[<dim>]`` (``program._guards_code``: what
    ``program.module()`` asserts), or None when this torch keeps no such list."""
    guards = getattr(program, "_guards_code", None)
    return None if guards is None else [str(g) for g in guards]


# What ``torch.no_grad()`` records as when a graph calls it bare (export's training IR wraps it in
# ``torch.ops.higher_order.wrap_with_set_grad_enabled`` instead; fxopt.capture.exception_safe).
BARE_SET_GRAD_ENABLED = torch._C._set_grad_enabled


# Where torch.utils.checkpoint dispatches: the reentrant autograd Function's ``apply``, and the
# non-reentrant generator ``checkpoint()`` calls through the module's globals. That one's name
# changes between releases (``_checkpoint_without_reentrant_generator`` in 2.11,
# ``..._generator_impl`` in 2.14), so it is read off ``checkpoint``'s own code: whatever name
# this torch's ``checkpoint()`` calls is the one gated.
_NON_REENTRANT_PREFIX = "_checkpoint_without_reentrant"
_REENTRANT_ENTRY = "CheckpointFunction.apply"


def checkpoint_entries() -> tuple[str, ...]:
    """The entry points of this torch's ``torch.utils.checkpoint.checkpoint`` that
    ``checkpoint_calls_refused`` gates: the reentrant ``CheckpointFunction.apply`` and every
    module-level non-reentrant generator ``checkpoint()`` calls."""
    from torch.utils import checkpoint as torch_checkpoint

    generators, seen = [], set()
    frontier = [torch_checkpoint.checkpoint]
    for _depth in range(4):  # checkpoint() -> [_checkpoint_impl() ->] the generator
        called = []
        for function in frontier:
            for name in inspect.unwrap(function).__code__.co_names:
                found = getattr(torch_checkpoint, name, None)
                if (name in seen or not inspect.isfunction(found)
                        or found.__module__ != torch_checkpoint.__name__):
                    continue
                seen.add(name)
                if name.startswith(_NON_REENTRANT_PREFIX):
                    generators.append(name)
                else:
                    called.append(found)
        frontier = called
    return (*generators, _REENTRANT_ENTRY)
_CHECKPOINT_REFUSAL: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "fxopt_checkpoint_refusal", default=None)
_GATES_LOCK = threading.Lock()
_GATES: list[Any] = [0, []]  # scopes open in any thread; the callables putting torch back


def _gate(entry: Callable) -> Callable:
    """``entry`` as it is, except in a thread inside ``checkpoint_calls_refused``."""
    @functools.wraps(entry)
    def gated(*args: Any, **kwargs: Any) -> Any:
        refuse = _CHECKPOINT_REFUSAL.get()
        if refuse is not None:
            refuse()
        return entry(*args, **kwargs)

    return gated


def _install_checkpoint_gates() -> list[Callable[[], None]]:
    from torch.utils import checkpoint as torch_checkpoint

    restore = []
    for path in checkpoint_entries():
        owner_name, _, name = path.rpartition(".")
        owner = getattr(torch_checkpoint, owner_name) if owner_name else torch_checkpoint
        entry = getattr(owner, name, None)
        if entry is None:
            continue
        # put back exactly what was there: the object in the owner's own dict, or nothing
        # (an inherited classmethod such as autograd.Function.apply)
        restore.append(functools.partial(setattr, owner, name, vars(owner)[name])
                       if name in vars(owner) else functools.partial(delattr, owner, name))
        setattr(owner, name, staticmethod(_gate(entry)) if isinstance(owner, type)
                else _gate(entry))
    return restore


@contextlib.contextmanager
def checkpoint_calls_refused(refuse: Callable[[], None]) -> Iterator[None]:
    """Inside, in this thread (and context) only, a call of ``torch.utils.checkpoint`` (either
    variant) runs ``refuse()`` first, which raises. Other threads checkpoint as usual: torch's
    two entry points are wrapped while any thread is inside (a wrapper that calls straight
    through elsewhere) and put back when the last one leaves."""
    with _GATES_LOCK:
        if _GATES[0] == 0:
            _GATES[1] = _install_checkpoint_gates()
        _GATES[0] += 1
    token = _CHECKPOINT_REFUSAL.set(refuse)
    try:
        yield
    finally:
        _CHECKPOINT_REFUSAL.reset(token)
        with _GATES_LOCK:
            _GATES[0] -= 1
            if _GATES[0] == 0:
                for put_back in _GATES[1]:
                    put_back()
                _GATES[1] = []
