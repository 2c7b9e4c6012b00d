"""Generate ``model.py``: an optimized GraphModule as a Python module that needs only torch.

``generate(gm, class_name)`` returns the module's source, the tensors it loads that are not in
``state_dict()`` (tracer constants, in ``constants.pt``), the fxopt runtime modules to copy next
to it and the outside modules it imports. The module holds:

- a header of small helpers (loading a runtime copy by path, making a module without running
  its ``__init__``, a zero parameter);
- one class per checkpointed region body, code only: its ``forward`` is torch.fx's own code
  generation of the body graph, run by the region with the state the call site passes as
  ``self`` (``fxopt.runtime.regions``);
- the model class: ``__init__`` rebuilds the module tree (``fxopt.export.module_tree``), attaches the
  constants, the input guard of an export-captured module (``InputGuard`` from the copied
  ``fxopt.runtime.input_guard``, raising the copied ``fxopt.runtime.errors.InputError``) and the
  regions (``CheckpointedRegion`` from the copied ``fxopt.runtime.regions``), and
  ``forward`` is torch.fx's code generation of the root graph;
- ``load(map_location)``: the class with ``state_dict.pt`` loaded (``weights_only=True``).

The module imports public torch modules only, and refuses to import (``ImportError`` saying what
to do) under a torch release other than the one it was generated with: torch.fx writes operators
by the names that release gives them. ``FXOPT_ALLOW_OTHER_TORCH=1`` loads it anyway.

Names are described in ``fxopt.export.names``, the tree in ``fxopt.export.module_tree``.
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxopt.capture.train_eval import dispatch_to_method, eval_graph
from fxopt.core.errors import ExportError
from fxopt.export.module_tree import TreeWriter, called_modules
from fxopt.export.names import Imports
from fxopt.runtime.input_guard import InputGuard
from fxopt.runtime.regions import CheckpointedRegion

# The method an exported module runs in eval mode when its forward depends on self.training
# (see fxopt.capture.train_eval): the eval-mode graph, generated like forward.
EVAL_METHOD = "_forward_eval"

HEADER = '''\
import importlib.util
import os
import sys
import weakref
from math import inf, nan
from pathlib import Path

import torch
from torch import device

NoneType = type(None)
_HERE = Path(__file__).resolve().parent


def _runtime(filename):
    """Load a runtime file of this folder as a module of a package made for the folder (the
    runtime files import each other relatively), under a name unique to the folder."""
    package = f"_fxopt_export_{abs(hash(str(_HERE)))}"
    if package not in sys.modules:
        spec = importlib.util.spec_from_loader(package, None, is_package=True)
        module = importlib.util.module_from_spec(spec)
        module.__path__.append(str(_HERE))
        sys.modules[package] = module
    return importlib.import_module(f"{package}.{Path(filename).stem}")


def _new(cls):
    """An instance of ``cls`` without running its __init__ (as pickle makes one)."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    return module


def _param(shape, dtype, requires_grad):
    return torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=requires_grad)

'''


# Checked when model.py is imported: the generated code imports public torch modules only, but
# torch.fx writes operators by the names the exporting release gives them (torch.ops.aten.*,
# torch._C._nn.linear), which another release may rename or change.
TORCH_CHECK = '''\
TORCH_VERSION = {version!r}  # the torch this file was generated with


def _release(version):
    return tuple(str(version).split("+")[0].split(".")[:2])


if _release(torch.__version__) != _release(TORCH_VERSION) and (
        not os.environ.get({allow!r})):
    raise ImportError(
        f"{{__name__}} was exported by fxopt with torch {{TORCH_VERSION}}, and torch "
        f"{{torch.__version__}} is installed: the generated code calls torch's operators by the "
        "names that release gives them, which another release may rename or change. Export the "
        "model again with this torch (fxopt optimize ... --out DIR), or set "
        "{allow}=1 to load it anyway and compare its outputs with the original")
'''
ALLOW_OTHER_TORCH = "FXOPT_ALLOW_OTHER_TORCH"  # the variable that loads it under another torch


@dataclass
class Generated:
    source: str
    class_name: str
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    runtime_files: dict[str, str] = field(default_factory=dict)   # file name -> source text
    needs: list[str] = field(default_factory=list)                 # modules besides torch
    regions: int = 0


_TAKEN = frozenset({"load", "torch", "device", "inf", "nan", "NoneType", "Path", "sys", "weakref",
                    "importlib", "os", "TORCH_VERSION", "fx_pytree", "pytree"})


def python_identifier(name: str) -> str:
    """``name`` made a class name that is valid and clashes with nothing in the module."""
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "Model"
    clashes = (cleaned[0].isdigit() or cleaned.startswith("_") or cleaned in _TAKEN
               or keyword.iskeyword(cleaned))
    return f"Exported{cleaned}" if clashes else cleaned


def _attach_constants(gm: fx.GraphModule, graphs: list[fx.Graph], tree: TreeWriter,
                      regions: dict) -> None:
    """Tensors the graphs read that are no parameter or buffer (tracer constants)."""
    known = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    attached: set[str] = set()
    for node in (n for graph in graphs for n in graph.nodes):
        if node.op != "get_attr" or node.target in regions or node.target in attached:
            continue
        attached.add(node.target)
        value = operator.attrgetter(node.target)(gm)
        if isinstance(value, nn.Module) or id(value) in known:
            continue
        owner, _, name = node.target.rpartition(".")
        owner_expr = f"self.get_submodule({owner!r})" if owner else "self"
        if isinstance(value, InputGuard):
            tree.lines.append(f"object.__setattr__({owner_expr}, {name!r}, "
                              f"{_guard_source(value, tree.imports, node.target)})")
            continue
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"cannot export: the graph reads {node.target!r}, a "
                              f"{type(value).__name__}", where=f"node {node.name}",
                              hint="only tensors, parameters, buffers and modules can be exported")
        tree.lines.append(f"object.__setattr__({owner_expr}, {name!r}, "
                          f"{tree.constant(value, node.target)})")


def _guard_source(guard: InputGuard, imports: Imports, where: str) -> str:
    """The constructor call that rebuilds ``guard`` (an export-captured module's input check)."""
    def literal(value: Any) -> str:
        if isinstance(value, type):
            return imports.reference(value, where)
        if isinstance(value, torch.dtype):
            return str(value)
        if dataclasses.is_dataclass(value):
            fields = ", ".join(f"{f.name}={literal(getattr(value, f.name))}"
                               for f in dataclasses.fields(value))
            return f"{imports.reference(type(value), where)}({fields})"
        if isinstance(value, tuple):
            return f"({''.join(literal(v) + ', ' for v in value)})"
        if isinstance(value, dict):
            return f"{{{', '.join(f'{literal(k)}: {literal(v)}' for k, v in value.items())}}}"
        if type(value) in (type(None), bool, int, float, str):
            return repr(value)
        raise ExportError(f"cannot export: the input guard holds a {type(value).__name__}",
                          where=where, hint="report this model to fxopt")

    return f"{literal(type(guard))}({', '.join(_constructor_arguments(guard, literal, where))})"


def _constructor_arguments(obj: Any, literal: Any, where: str) -> list[str]:
    """``obj``'s constructor arguments, each written by ``literal``, read from the attributes
    named like ``__init__``'s parameters (how ``InputGuard`` keeps them), so a field added to
    the constructor is exported without a change here. A parameter with a default whose
    attribute is missing is left out; one without is an ``ExportError``."""
    arguments = []
    parameters = list(inspect.signature(type(obj)).parameters.values())
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ExportError(f"cannot export: {type(obj).__name__}'s constructor takes "
                              f"*{parameter.name}, which its attributes cannot give back",
                              where=where, hint="report this as an fxopt bug")
        if not hasattr(obj, parameter.name):
            if parameter.default is parameter.empty or \
                    parameter.kind == parameter.POSITIONAL_ONLY:
                raise ExportError(f"cannot export: {type(obj).__name__} has no attribute "
                                  f"{parameter.name!r} to rebuild it from", where=where,
                                  hint="report this as an fxopt bug")
            continue
        value = literal(getattr(obj, parameter.name))
        arguments.append(value if parameter.kind == parameter.POSITIONAL_ONLY
                         else f"{parameter.name}={value}")
    return arguments


def _code_class(name: str, doc: str, graph: fx.Graph, what: str, imports: Imports) -> str:
    """A module class that holds no state: its ``forward`` is ``graph``'s generated code."""
    return (f"class {name}(torch.nn.Module):\n    \"\"\"{doc}\"\"\"\n\n"
            f"{imports.forward_source(graph, what)}\n")


def _graph_bodies(gm: fx.GraphModule, attributes: dict[str, Any]) -> dict[str, fx.GraphModule]:
    """The graphs ``gm`` calls that are plain attributes, not submodules: the bodies of
    torch.export's scoped calls (``fxopt.runtime.scoped``). They must be code only."""
    submodules = {name for name, _ in gm.named_modules()}
    bodies = {t: v for t, v in attributes.items()
              if isinstance(v, fx.GraphModule) and t not in submodules}
    for target, body in bodies.items():
        if body.graph.find_nodes(op="get_attr") or body.graph.find_nodes(op="call_module"):
            raise ExportError(f"cannot export {target}: a graph body that reads state of its own",
                              where=f"attribute {target}", hint="report this model to fxopt")
    return bodies


def generate(gm: fx.GraphModule, class_name: str) -> Generated:
    """The source of ``model.py`` for ``gm`` and what it needs (see the module docstring)."""
    imports = Imports()
    in_eval = eval_graph(gm)
    graphs = [gm.graph, *([in_eval] if in_eval is not None else [])]
    attributes = {n.target: operator.attrgetter(n.target)(gm) for graph in graphs
                  for n in graph.find_nodes(op="get_attr")}
    regions = {t: v for t, v in attributes.items() if isinstance(v, CheckpointedRegion)}
    tree = TreeWriter(imports, called_modules(gm, [*graphs, *(r.body.graph
                                                              for r in regions.values())]))
    tree.module(gm)
    _attach_constants(gm, graphs, tree, regions)
    classes = []
    for index, (attr, graph_body) in enumerate(_graph_bodies(gm, attributes).items()):
        body = f"_GraphBody{index}"
        classes.append(_code_class(body, f"The graph {attr} calls in a scope.", graph_body.graph,
                                   f"body {attr}", imports))
        tree.lines.append(f"object.__setattr__(self, {attr!r}, {body}())")
    for index, (attr, region) in enumerate(regions.items()):
        body = f"_RegionBody{index}"
        classes.append(_code_class(
            body, f"The body of checkpointed region {attr}: code run over the state its call "
            "site passes.", region.body.graph, f"region {attr}", imports))
        runtime_class = imports.reference(type(region), f"region {attr}")
        if region.targets is None:
            raise ExportError(f"cannot export region {attr}: it holds its own state (an "
                              "optimized module saved by fxopt 0.1)", where=f"region {attr}",
                              hint="optimize the model again with this fxopt, then export it")
        tree.lines.append(f"object.__setattr__(self, {attr!r}, {runtime_class}({body}(), "
                          f"selective={bool(region.selective)!r}, targets={region.targets!r}))")
    if in_eval is None:
        forward = imports.forward_source(gm.graph, "forward")
    else:
        forward = "\n\n".join([
            imports.forward_source(dispatch_to_method(gm.graph, EVAL_METHOD), "forward"),
            imports.forward_source(in_eval, "eval-mode forward", name=EVAL_METHOD)])
    init = ["    def __init__(self):", "        super().__init__()"]
    if tree.constants:
        init.append("        _constants = torch.load(_HERE / 'constants.pt', weights_only=True)")
    init += ["        " + line for line in tree.lines]
    needs = f" and {', '.join(imports.needs)}" if imports.needs else ""
    source = "\n".join([
        f'"""{class_name} as optimized by fxopt, written as plain PyTorch (needs torch'
        f'{needs}).\n\nmodel = load()  # or {class_name}() then load_state_dict(...)\n"""\n',
        HEADER, TORCH_CHECK.format(version=str(torch.__version__), allow=ALLOW_OTHER_TORCH),
        *imports.lines,
        *(f"{name} = {expr}" for name, expr in imports.fx_globals.items()), "",
        f"__all__ = [{class_name!r}, 'load']", "", "", *classes,
        f"class {class_name}(torch.nn.Module):",
        f'    """{class_name} as optimized by fxopt; weights: load() or load_state_dict()."""\n',
        *init, "", forward, "", "",
        "def load(map_location='cpu'):",
        f'    """A {class_name} with the exported weights (state_dict.pt)."""',
        f"    model = {class_name}()",
        "    state = torch.load(_HERE / 'state_dict.pt', map_location=map_location, "
        "weights_only=True)",
        "    model.load_state_dict(state)",
        "    return model.to(map_location)", ""])
    return Generated(source, class_name, dict(tree.constants), dict(imports.runtime_files),
                     list(imports.needs), len(regions))
