"""Module trees: the one structural copy, and the one answer to "does this module have hooks".

``structural_copy(model)`` gives fxopt a module tree of its own to trace and rewrite while the
user's Parameters and buffers stay the very tensors an optimizer holds. ``has_hooks(module)`` is
what every pass asks before it replaces, removes or looks through a module call.

Both read nn.Module's per-instance internals (``_parameters``, ``_modules``, the hook dicts);
``MODULE_CONTAINERS`` is read off a fresh ``nn.Module()``, so a torch release that adds a hook
dict is covered without a change here.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from fxopt.core import meta_keys
from fxopt.core.dropouts import DROPOUT_MODULES
from fxopt.core.torch_private import (
    COMPILED_CALL,
    FULL_BACKWARD_HOOK_FLAG,
    GRAPH_MODULE_CONTAINERS,
    RNN_WEIGHT_CACHES,
    NormBase,
)
from fxopt.runtime.module_hooks import CALL_HOOK_DICTS, call_hooks, has_hooks  # noqa: F401

# Every dict or set ``nn.Module.__init__`` gives an instance. On torch 2.14: _parameters,
# _buffers, _non_persistent_buffers_set, _modules, and 11 hook dicts: forward pre/post hooks and
# their with_kwargs/always_call marks, backward pre/post hooks, state_dict and load_state_dict
# pre/post hooks.
MODULE_CONTAINERS: tuple[str, ...] = tuple(
    name for name, value in vars(nn.Module()).items() if isinstance(value, (dict, set)))
HOOK_DICTS: tuple[str, ...] = tuple(name for name in MODULE_CONTAINERS if "hook" in name)

# Per-instance containers of torch's own subclasses: GraphModule's (besides its graph, which is
# copied node by node), and the RNN weight list that ``rnn.weight_ih_l0 = ...`` updates in place.
_CLASS_CONTAINERS: tuple[tuple[type, tuple[str, ...]], ...] = (
    (fx.GraphModule, ("meta", *GRAPH_MODULE_CONTAINERS)),
    (nn.RNNBase, tuple(sorted(RNN_WEIGHT_CACHES))),
)


# The constants of torch.nn modules (``__constants__``) a script may set on a built module without
# touching its parameters; the others (sizes, strides, ``affine``) come with the parameters.
_SETTABLE_CONSTANTS = frozenset({
    "p", "eps", "momentum", "track_running_stats", "negative_slope", "alpha", "beta",
    "approximate", "threshold", "lambd", "min_val", "max_val", "lower", "upper",
})


@functools.cache
def settable_constants(cls: type) -> tuple[str, ...]:
    """The attributes a ``torch.nn`` module class declares constant (``__constants__``) that a
    script may set after building it: a Dropout's ``p``, a norm's ``eps`` and ``momentum``, a
    LeakyReLU's slope; what a graph that runs such a module inline has baked in. ``()`` for
    classes outside ``torch.nn``."""
    if not cls.__module__.startswith("torch.nn."):
        return ()
    return tuple(n for n in getattr(cls, "__constants__", ()) if n in _SETTABLE_CONSTANTS)


# What a value a graph may have built in is, when a module of a class outside torch holds it as a
# plain attribute: a flag its forward branches on, a scale, a size, a dtype.
_SCALAR_TYPES = frozenset({bool, int, float, complex, str, type(None), torch.dtype,
                           torch.device})


def constant_values(module: nn.Module) -> tuple[tuple[str, object], ...]:
    """What a graph that runs ``module`` inline may have built in, as (name, value) pairs. For a
    ``torch.nn`` class: its ``settable_constants``. For a class of the user's or a library's
    (a Hugging Face attention's ``scaling``, a flag its ``forward`` branches on): every public
    attribute of the instance holding a scalar (bool, int, float, str, None, a dtype or a device),
    or a tuple or list of those (nested too), whether or not ``forward`` reads it: which it
    reads, the graph no longer says. A list comes as a copy (``_snapshot``), so a record of the
    values compares unequal to them once the list is changed in place. A class FSDP2's
    ``fully_shard`` made (``FSDP<class>``) counts as its class; a block ``fxopt.rewrite.blocks``
    kept (a GraphModule) counts as the module it stands for (``meta_keys.BLOCK_CONSTANTS``: a
    deleted one reads as ``UNSET``)."""
    if isinstance(module, fx.GraphModule):
        recorded = module.meta.get(meta_keys.BLOCK_CONSTANTS, {})
        return tuple((name, _snapshot(module.__dict__.get(name, UNSET))) for name in recorded)
    names = torch_constants(type(module))
    if names is not None:
        return tuple((name, getattr(module, name, None)) for name in names)
    return tuple((name, _snapshot(value)) for name, value in module.__dict__.items()
                 if name[0] != "_" and name != "training" and _is_scalar(value))


def carry_constants(module: nn.Module, graph_module: fx.GraphModule) -> None:
    """Give ``graph_module``, which stands for ``module`` (a block ``fxopt.rewrite.blocks`` kept,
    or the optimized module for the user's root), the ``constant_values`` of ``module`` it has
    no attribute of, readable on it as on ``module``, and record them
    (``meta_keys.BLOCK_CONSTANTS``): whatever ``module``'s forward read of them, the graph has
    built in, so the call guard refuses a call after one of them was set anew or deleted."""
    constants = {name: value for name, value in constant_values(module)
                 if not hasattr(graph_module, name)}
    for name, value in constants.items():  # a list of its own, apart from the record
        object.__setattr__(graph_module, name, _snapshot(value))
    graph_module.meta[meta_keys.BLOCK_CONSTANTS] = constants


class _Unset:
    """What ``constant_values`` reads for a recorded attribute deleted since."""

    def __repr__(self) -> str:
        return "not set"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET = _Unset()


def _is_scalar(value: object) -> bool:
    """A scalar, or a tuple or list of them (nested too): data a forward may branch on or
    compute with, which a capture builds into the graph."""
    if type(value) is tuple or type(value) is list:
        return all(_is_scalar(item) for item in value)
    return type(value) in _SCALAR_TYPES


def _snapshot(value: object) -> object:
    """``value`` (``_is_scalar``) with every list in it copied: the values as they are now."""
    if type(value) is list:
        return [_snapshot(item) for item in value]
    if type(value) is tuple and any(type(item) is list or type(item) is tuple for item in value):
        return tuple(_snapshot(item) for item in value)
    return value


@functools.cache
def torch_constants(cls: type) -> tuple[str, ...] | None:
    """The ``settable_constants`` of a torch class, None for another class. A class FSDP2's
    ``fully_shard`` made counts as the one it made it from (its first base outside
    ``torch.distributed``). Cached: the call guard asks it of every module on every call."""
    base = next((c for c in cls.__mro__ if not c.__module__.startswith("torch.distributed.")),
                cls)
    return settable_constants(base) if base.__module__.startswith("torch.") else None


def reads_its_own_mode(module: nn.Module) -> bool:
    """A torch module whose computation depends on its own ``training`` flag: a norm with running
    statistics (BatchNorm, InstanceNorm with ``track_running_stats``), a dropout that drops."""
    if isinstance(module, NormBase):
        return bool(module.track_running_stats)
    return isinstance(module, DROPOUT_MODULES) and module.p != 0


def modules_as_they_are(root: nn.Module, paths: set[str]) -> tuple[tuple, ...]:
    """A record of the modules at ``paths`` under ``root`` and of every module above them,
    parents first: (its parent, its name there, the module, its class, its ``training`` flag,
    whether it has hooks, its ``constant_values``, whether it can have any), for
    ``still_as_they_were``."""
    every = set(paths)
    for path in paths:
        parts = path.split(".")
        every.update(".".join(parts[:end]) for end in range(1, len(parts)))
    every.discard("")
    record = []
    for path in sorted(every, key=lambda p: (p.count("."), p)):
        owner, _, name = path.rpartition(".")
        parent = root.get_submodule(owner)
        module = parent._modules.get(name)
        if module is not None:
            constants = constant_values(module)
            record.append((parent, name, module, type(module), module.training,
                           has_hooks(module), constants,
                           bool(constants) or isinstance(module, fx.GraphModule)
                           or torch_constants(type(module)) is None))
    return tuple(record)


def still_as_they_were(record: tuple[tuple, ...]) -> bool:
    """Whether every module ``modules_as_they_are`` recorded is where it was, of its class, in
    its mode, with hooks or without as it was, with its constants. ``has_hooks`` is inlined and
    ``constant_values`` asked only of a module that can have any: the call guard asks this on
    every call."""
    for parent, name, module, cls, training, hooked, constants, ask in record:
        if (parent._modules.get(name) is not module or type(module) is not cls
                or module.training is not training):
            return False
        state = module.__dict__
        for hook_dict in CALL_HOOK_DICTS:
            if state.get(hook_dict):
                if not hooked:
                    return False
                break
        else:
            if hooked:
                return False
        if ask and constant_values(module) != constants:
            return False
    return True


def copy_hooks(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` shallow copies of all of ``source``'s hook dicts, replacing its own.

    The hook functions are shared; registering or removing a hook on either module afterwards
    does not affect the other (a handle returned before the copy removes the hook from
    ``source`` only).
    """
    for name in HOOK_DICTS:
        if name in source.__dict__:
            target.__dict__[name] = copy.copy(source.__dict__[name])
    if FULL_BACKWARD_HOOK_FLAG in source.__dict__:
        target.__dict__[FULL_BACKWARD_HOOK_FLAG] = source.__dict__[FULL_BACKWARD_HOOK_FLAG]


def deepcopy_keeping_hooks(module: fx.GraphModule, memo: dict) -> fx.GraphModule:
    """``copy.deepcopy`` of a GraphModule that keeps its hooks, as an ``nn.Module``'s deep copy
    does. torch.fx's own keeps only the state_dict hooks: a forward hook the user registered
    on the model (``fxopt.capture.trace.graph_module_like`` copies it onto the optimized module)
    or fxopt's shard guard would be gone from the copy, which would then compute another
    function than ``copy.deepcopy(model)``. A block's scalar attributes
    (``meta_keys.BLOCK_CONSTANTS``) are kept too. Install it as the class's ``__deepcopy__``."""
    copied = fx.GraphModule.__deepcopy__(module, memo)
    if meta_keys.CHECKED in copied.meta:  # the call guard's record of what it last found
        copied.meta[meta_keys.CHECKED] = {}  # holds modules: the copy is checked afresh
    for name in (*HOOK_DICTS, FULL_BACKWARD_HOOK_FLAG):
        if name in module.__dict__:
            copied.__dict__[name] = copy.deepcopy(module.__dict__[name], memo)
    _plain_attributes_stay_plain(module, copied)
    for name in module.meta.get(meta_keys.BLOCK_CONSTANTS, ()):  # a block's, which its graph
        if name in module.__dict__:                                # does not read
            copied.__dict__[name] = copy.deepcopy(module.__dict__[name], memo)
    carry_instance_methods(module, copied)
    return copied


def _plain_attributes_stay_plain(source: nn.Module, copied: nn.Module) -> None:
    """torch.fx's deep copy registers every tensor a graph reads as a buffer; one that is a plain
    attribute of ``source`` (a tensor constant torch.export lifted out of forward) goes back to
    being one, so the copy's ``state_dict`` keys are the source's and a checkpoint of the model
    loads into it."""
    for path, owner in source.named_modules():
        try:
            twin = copied.get_submodule(path)
        except AttributeError:
            continue
        for name in [n for n in twin._buffers if n not in owner._buffers and n in vars(owner)]:
            value = twin._buffers.pop(name)
            twin._non_persistent_buffers_set.discard(name)
            object.__setattr__(twin, name, value)


def carry_instance_methods(source: fx.GraphModule, copied: fx.GraphModule) -> None:
    """Give ``copied`` what ``set_instance_method`` set on ``source``'s own class: fx makes the
    copy a class of its own, derived from GraphModule (or from the first class of ``source``'s
    that is no per-instance one: ``PretrainedInterface``) rather than from ``source``'s class,
    and the copy's copies must keep what that class overrides (keeping hooks on a deep copy, the
    eval graph's attributes, refusing pickling). Each method is taken from the first class of
    ``source``'s that defines it, unless the copy's class inherits it from there anyway."""
    if type(copied) is type(source):
        return
    kept = set(type(copied).__mro__)  # what the copy's class derives from, it inherits
    for name in _PER_INSTANCE_CLASS_METHODS:
        owner = next(cls for cls in type(source).__mro__ if name in vars(cls))
        if owner not in kept:  # a class of the source's own, or one derived from it (the
            setattr(type(copied), name, vars(owner)[name])  # Hugging Face interface's base)


# What fxopt sets on a GraphModule's own class (``deepcopy_keeping_hooks``, the eval-mode
# graph's deep copy and pickling refusal in ``fxopt.graph.train_eval``).
_PER_INSTANCE_CLASS_METHODS = ("__deepcopy__", "__reduce__")


def set_instance_method(gm: fx.GraphModule, name: str, function: Callable) -> None:
    """Give ``gm`` alone the special method ``name``: the one place fxopt patches a class.

    Python looks special methods (``__deepcopy__``, ``__reduce__``) up on the class, never on
    the instance, and torch.fx gives every GraphModule a class of its own (``GraphModule.__new__``
    makes a ``GraphModuleImpl`` subclass per instance), so setting it there changes this module
    alone; ``deepcopy_keeping_hooks`` carries it to copies. Raises ``RuntimeError`` where the
    class is not the instance's own (a torch that stops making them), rather than patching every
    GraphModule in the process."""
    cls = type(gm)
    if name not in _PER_INSTANCE_CLASS_METHODS:
        raise ValueError(f"set_instance_method: {name!r} is not one of "
                         f"{_PER_INSTANCE_CLASS_METHODS} (copies would lose it)")
    # torch.fx names the class GraphModuleImpl (its __init__ then renames it after the model,
    # but not its qualified name)
    if cls is fx.GraphModule or not issubclass(cls, fx.GraphModule) or (
            "GraphModuleImpl" not in cls.__qualname__):
        raise RuntimeError(f"{cls.__qualname__} is not a per-instance GraphModule class: "
                           f"setting {name} on it would change other modules too")
    setattr(cls, name, function)


def structural_copy(model: nn.Module) -> nn.Module:
    """A new module tree shaped like ``model`` whose Parameters and buffers are ``model``'s own.

    Every module is a new object of the same class (see GraphModule below) with the same
    ``__dict__`` entries, except that each of nn.Module's per-instance containers
    (``MODULE_CONTAINERS``: ``_modules``, ``_parameters``, ``_buffers``,
    ``_non_persistent_buffers_set`` and every hook dict) is a shallow copy. So on the copy one may
    add, remove or replace submodules, parameters, buffers and hooks, and set flags such as
    ``training`` or ``inplace``, without the user's modules seeing it, while the Parameter and
    buffer objects themselves are shared: an optimizer over the copy's parameters trains the
    user's, and in-place updates of a buffer (BatchNorm's running statistics) land in the
    user's buffer.

    A module reachable at several paths (``self.a = m; self.b = m``) is copied once, so the copy
    shares it at the same paths; tied parameters stay tied. Hooks registered on ``model``'s
    modules before the copy fire on the copy too (with the copy as their ``module`` argument);
    hooks registered, or removed through their handles, afterwards affect one side only.

    GraphModule: each instance has a class of its own holding its generated ``forward``, so the
    copy is an instance of a new such class over the same base, with a node-by-node copy of the
    graph (node ``meta`` copied shallowly) and its own ``meta`` dict, and the special methods
    fxopt set on the original's class (``carry_instance_methods``); editing and recompiling the
    copy leaves the original as it was, except its eval-mode graph, which lives in the mode
    dispatch and stays shared (``fxopt.capture.reuse`` gives a reused capture's copy its own;
    ``keep_blocks`` edits it in place). A ``torch.compile``-d module (``module.compile()``) is
    copied uncompiled, as ``copy.copy`` and pickling do.

    An RNN's list of its weights (``_flat_weights``, which ``rnn.weight_ih_l0 = ...`` updates in
    place) is copied too.

    A list of scalars (``constant_values``: data a forward may compute with, which the call guard
    compares with what it was) is copied too, so that the user's model changing its own, in
    place, leaves the copy's as it was.

    Not copied, so shared with ``model``: every other attribute value -- tensors and modules held
    as plain attributes (not registered), other lists and dicts a user's module keeps, and
    classes: ``torch.nn.utils.parametrize`` makes a class per module, so registering or removing
    a parametrization on the copy changes that class for the original too. Closures of hooks and
    of forward methods still refer to whatever they captured. A class whose ``__new__`` needs
    arguments cannot be copied (TypeError).
    """
    memo: dict[int, nn.Module] = {}

    def copy_module(module: nn.Module) -> nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        # cls.__new__, not copy.copy: a class's own copy or pickle protocol (GraphModule
        # rebuilds itself, parametrized modules refuse) is not a structural copy.
        new = type(module).__new__(type(module))
        memo[id(module)] = new
        state = {name: _snapshot(value) if _is_scalar(value) else value
                 for name, value in module.__dict__.items()}
        state.pop(COMPILED_CALL, None)
        containers = MODULE_CONTAINERS + tuple(
            name for cls, names in _CLASS_CONTAINERS if isinstance(module, cls) for name in names)
        for name in containers:
            if name in state:
                state[name] = copy.copy(state[name])
        state["_modules"] = {name: None if child is None else copy_module(child)
                             for name, child in module._modules.items()}
        new.__dict__.update(state)
        if isinstance(module, fx.GraphModule):
            new.graph = copy.deepcopy(module.graph)  # owned by the copy, which it recompiles
            carry_instance_methods(module, new)
        return new

    return copy_module(model)


def own_tensors(module: nn.Module) -> tuple[dict, dict]:
    """Copies of ``module``'s own (not its children's) name -> Parameter and name -> buffer
    slots, None entries included, for ``restore_own_tensors``."""
    return dict(module._parameters), dict(module._buffers)


def restore_own_tensors(module: nn.Module, held: tuple[dict, dict]) -> None:
    """Put back the objects ``own_tensors`` saw in ``module``'s slots (a swapped-in tensor is
    replaced by the original object; slots added since are left)."""
    module._parameters.update(held[0])
    module._buffers.update(held[1])


def own_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s direct submodule slots in registration order, None entries included
    (``named_children`` skips those)."""
    return dict(module._modules)


def replace_child(parent: nn.Module, name: str, child: nn.Module) -> None:
    """Put ``child`` in ``parent``'s submodule slot ``name``, keeping the slot's place in the
    registration order (``setattr`` would too, but runs ``parent``'s own ``__setattr__``)."""
    parent._modules[name] = child


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers that ``state_dict()`` leaves out."""
    return set(module._non_persistent_buffers_set)


def share_tree(target: nn.Module, source: nn.Module) -> None:
    """Make ``target``'s own submodules, parameters and buffers those of ``source`` (the same
    objects, in the same order; non-persistent buffers too), in containers of ``target``'s own,
    so adding to one module later does not add to the other."""
    target._modules.clear()
    target._modules.update(source._modules)
    target._parameters = copy.copy(source._parameters)
    target._buffers = copy.copy(source._buffers)
    target._non_persistent_buffers_set = set(source._non_persistent_buffers_set)


def wrap_own_calls(graph: fx.Graph) -> bool:
    """Mark ``graph``'s calls of fxopt's own functions as ``torch.fx.wrap`` marks a wrapped
    call, so the code generated from it wraps them and torch.load's re-trace of that code
    records each as the call it is. Traced into, they would change what the graph does: a
    region's recomputation given a stand-in for its BatchNorm (``code_only_module``) would call
    that module, and so update its running statistics a second time in every backward. Returns
    whether a node was marked (the module's code must then be generated again)."""
    marked = False
    for node in graph.nodes:
        if node.op == "call_function" and (getattr(node.target, "__module__", None) or ""
                                           ).startswith("fxopt.") and not node.meta.get("is_wrapped"):
            node.meta["is_wrapped"] = True
            marked = True
    return marked


def code_only_module(graph: fx.Graph, root: nn.Module, class_name: str) -> fx.GraphModule:
    """A GraphModule of ``graph`` that holds no state of ``root``: its ``forward`` is meant to
    run with ``root`` (or what stands for it) as ``self``.

    Every attribute the graph reads is a stand-in (an empty module, a zero-size meta tensor), so
    the module copies and pickles as code (torch.fx re-traces its code on load with the stand-ins
    as ``self``, fxopt's own calls wrapped: ``wrap_own_calls``) and keeps no tensor alive; ``type(module).forward(root, ...)`` is the graph's
    code on ``root``'s live state.
    """
    wrap_own_calls(graph)
    targets = dict.fromkeys(n.target for n in graph.nodes if n.op in ("get_attr", "call_module"))
    stand_ins = {}
    for target in sorted(targets, key=lambda t: t.count(".")):  # owners before their members
        value = operator.attrgetter(target)(root)
        stand_ins[target] = (nn.Module() if isinstance(value, nn.Module)
                             else torch.empty(0, device="meta"))
    return fx.GraphModule(stand_ins, graph, class_name=class_name)
