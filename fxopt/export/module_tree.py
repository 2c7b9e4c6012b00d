"""Rebuild a GraphModule's module tree as code: the ``__init__`` of the exported model.

The tree has the same modules under the same names, so ``state_dict()`` keys, their order and
the parameters' shapes, dtypes and ``requires_grad`` are the original's; tied parameters and a
module used at two places stay shared. Parameters and buffers start as zeros: the weights come
from ``load_state_dict``. Non-persistent buffers (a rotary embedding's ``inv_freq``), which
``state_dict()`` leaves out, start with their values at export time, from ``constants.pt``.

A graph module the export writes as a class of its own (a block the root graph calls,
``fxopt.export.blocks``) is an instance of that class, holding its own parameters, buffers and
children. Any other module the graphs call (and everything below it) is rebuilt as an instance
of its own class the way ``pickle`` and ``copy`` make one -- ``cls.__new__``, then
``nn.Module.__init__``, then its attributes -- but written as code: plain values (numbers,
strings, tuples, dtypes, devices) as literals, functions and classes as imports, references to
the module's parameters and buffers as such, other tensors through ``constants.pt``. torch's RNNs
get their weight cache rebuilt by their own ``_init_flat_weights()``. Every other module is only
a namespace (torch.fx inlined its forward when tracing) and becomes a plain ``torch.nn.Module``,
but for torch's containers (``ModuleList``, ``Sequential``, ``ModuleDict``), which stay what they
were, so ``model.layers[3]`` indexes the exported module as it does the original.

Not handled (``ExportError`` names the module and the attribute): hooks on a called module or
a block, modules or other objects held as plain attributes, lazy or non-dense parameters.
"""

from __future__ import annotations

import inspect
import itertools
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from fxopt.core.errors import ExportError
from fxopt.core.modules import (
    HOOK_DICTS,
    non_persistent_buffers,
    own_children,
    own_tensors,
)
from fxopt.core.torch_private import (
    RNN_WEIGHT_CACHES,
    RNN_WEIGHT_REBUILD,
    keeps_rnn_weight_cache,
)
from fxopt.export.names import Imports

_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)  # hold children and nothing else


def called_modules(gm: fx.GraphModule, graphs: list[fx.Graph]) -> set[int]:
    """ids of the modules the graphs (run on ``gm``) call, and of everything below them; not
    of graph modules, written as classes of their own: their graphs say what they call."""
    called: set[int] = set()
    for graph in graphs:
        for node in graph.find_nodes(op="call_module"):
            module = gm.get_submodule(node.target)
            if not isinstance(module, fx.GraphModule):
                called.update(id(m) for m in module.modules())
    return called


def literal(value: Any, imports: Imports, where: str, known: dict[int, str],
            constant: Callable[[torch.Tensor], str]) -> str:
    """Python source for a plain attribute value; ``known`` maps tensor ids to expressions."""
    again = lambda v: literal(v, imports, where, known, constant)  # noqa: E731
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, torch.Tensor):
        return known.get(id(value)) or constant(value)
    if isinstance(value, weakref.ref):  # a cache by nature; a reference elsewhere is dropped
        return f"weakref.ref({known[id(value())]})" if id(value()) in known else "None"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return repr(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, torch.Size):
        return f"torch.Size({list(value)!r})"
    if isinstance(value, tuple):
        items = [again(v) for v in value]
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    if isinstance(value, list):
        return f"[{', '.join(again(v) for v in value)}]"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}([{', '.join(again(v) for v in value)}])"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{again(k)}: {again(v)}" for k, v in value.items()) + "}"
    if inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.isclass(value):
        return imports.reference(value, where)
    raise ExportError(
        f"cannot export: {where} holds a {type(value).__name__}, which cannot be written as code",
        where=where,
        hint="keep only plain values (numbers, strings, tuples, dtypes), functions and "
             "registered parameters, buffers and submodules on modules the graph calls")


class TreeWriter:
    """Emits the lines of ``__init__`` that rebuild a module tree under ``self``."""

    def __init__(self, imports: Imports, called: set[int], classes: dict[int, str]):
        self.imports = imports
        self.called = called
        self.classes = classes            # id of a graph module -> the class written for it
        self.lines: list[str] = []
        self.constants: dict[str, torch.Tensor] = {}
        self.names: dict[int, str] = {}   # id of a module or tensor -> its variable
        self._count = itertools.count(1)

    def constant(self, tensor: torch.Tensor, key: str) -> str:
        """An expression for a tensor saved in ``constants.pt`` under ``key``."""
        self.constants[key] = tensor.detach().cpu()
        return f"_constants[{key!r}]"

    def module(self, module: nn.Module, path: str = "", var: str = "self") -> None:
        """Emit ``module`` (as ``var``) with its parameters, buffers and children."""
        where = f"module {path or '<root>'} ({type(module).__name__})"
        rebuilt = var != "self" and id(module) in self.called
        if var != "self" and id(module) in self.classes:
            _refuse_hooks(module, where)
            self.lines.append(f"{var} = {self.classes[id(module)]}()")
        elif rebuilt:
            self.lines.append(f"{var} = _new({self.imports.reference(type(module), where)})")
        elif var != "self":
            namespace = type(module) if type(module) in _CONTAINERS else nn.Module
            self.lines.append(f"{var} = torch.nn.{namespace.__name__}()")
        self.names[id(module)] = var
        self.lines.append(f"{var}.training = {module.training!r}")
        own: dict[int, str] = {}
        parameters, buffers = own_tensors(module)
        for name, param in parameters.items():
            expr = self._tensor(param, f"{where}.{name}", parameter=True)
            self.lines.append(f"{var}.register_parameter({name!r}, {expr})")
            if param is not None:
                own.setdefault(id(param), f"getattr({var}, {name!r})")
        for name, buffer in buffers.items():
            persistent = name not in non_persistent_buffers(module)
            expr = self._tensor(buffer, f"{where}.{name}", parameter=False,
                                value_key=None if persistent else
                                f"{path}.{name}" if path else name)
            self.lines.append(f"{var}.register_buffer({name!r}, {expr}, "
                              f"persistent={persistent!r})")
            if buffer is not None:
                own.setdefault(id(buffer), f"getattr({var}, {name!r})")
        for name, child in own_children(module).items():
            if child is not None and id(child) not in self.names:
                self.module(child, f"{path}.{name}" if path else name, f"m{next(self._count)}")
            child_var = "None" if child is None else self.names[id(child)]
            self.lines.append(f"{var}.add_module({name!r}, {child_var})")
        if rebuilt:
            self._attributes(module, path, var, where, own)

    def _tensor(self, tensor: torch.Tensor | None, where: str, *, parameter: bool,
                value_key: str | None = None) -> str:
        """A variable for ``tensor``: zeros of its shape and dtype (``load_state_dict`` fills
        them), or, with ``value_key``, its value from ``constants.pt`` (a non-persistent buffer,
        which no state_dict carries)."""
        if tensor is None:
            return "None"
        if id(tensor) in self.names:  # tied weights stay tied
            return self.names[id(tensor)]
        if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, nn.Parameter):
            raise ExportError(f"cannot export: {where} is a {type(tensor).__name__} with layout "
                              f"{tensor.layout}", where=where,
                              hint="only dense, materialized parameters and buffers export")
        shape, dtype = tuple(tensor.shape), repr(tensor.dtype)
        var = f"t{next(self._count)}"
        if parameter:
            self.lines.append(f"{var} = _param({shape!r}, {dtype}, {tensor.requires_grad!r})")
        elif value_key is not None:
            self.lines.append(f"{var} = {self.constant(tensor, value_key)}")
        else:
            self.lines.append(f"{var} = torch.zeros({shape!r}, dtype={dtype})")
        self.names[id(tensor)] = var
        return var

    def _attributes(self, module: nn.Module, path: str, var: str, where: str,
                    own: dict[int, str]) -> None:
        _refuse_hooks(module, where)
        rnn = keeps_rnn_weight_cache(module)
        skipped = _MODULE_INTERNALS | (RNN_WEIGHT_CACHES if rnn else frozenset())
        known = {**self.names, **own}
        counter = itertools.count()
        items = []
        for name, value in vars(module).items():
            if name in skipped:
                continue
            if isinstance(value, nn.Module) and id(value) not in self.names:
                raise ExportError(f"cannot export: {where} holds module {name!r} as a plain "
                                  "attribute", where=f"{where}.{name}",
                                  hint="register it as a submodule")
            expr = (self.names[id(value)] if isinstance(value, nn.Module) else
                    literal(value, self.imports, f"{where}.{name}", known,
                            lambda t: self.constant(t, f"{path}:{next(counter)}")))
            items.append(f"{name!r}: {expr}")
        if items:
            self.lines.append(f"{var}.__dict__.update({{{', '.join(items)}}})")
        if rnn:
            self.lines.append(f"{var}.{RNN_WEIGHT_REBUILD}()")


def _refuse_hooks(module: nn.Module, where: str) -> None:
    """An ``ExportError`` when ``module`` has hooks, which the generated code would not run."""
    hooks = [name for name in HOOK_DICTS if getattr(module, name, None)]
    if hooks:
        raise ExportError(f"cannot export: {where} has hooks ({', '.join(hooks)})", where=where,
                          hint="remove the hooks (e.g. torch.nn.utils.remove_weight_norm) "
                               "before optimizing, or use the optimized module from Python")
