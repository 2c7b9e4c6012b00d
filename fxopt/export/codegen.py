"""Generate ``model.py``: an optimized GraphModule as a Python module that needs only torch.

``generate(gm, class_name)`` returns the module's source, the tensors it loads that are not in
``state_dict()`` (tracer constants, in ``constants.pt``), the fxopt runtime modules to copy next
to it and the outside modules it imports. The module holds:

- a header of small helpers (loading a runtime copy by path, making a module without running
  its ``__init__``, a zero parameter);
- one class per block the graph calls (``fxopt.export.blocks``), code only: its ``forward`` is
  torch.fx's code generation of the block's graph (with ``EVAL_METHOD`` for its eval-mode graph
  when it has one); blocks with the same code share the class;
- one class per distinct checkpointed region body, code only: its ``forward`` is torch.fx's own code
  generation of the body graph, run by the region with the state the call site passes as
  ``self`` (``fxopt.runtime.regions``), and one per distinct scoped graph body (torch.export's);
- the model class: ``__init__`` rebuilds the module tree (``fxopt.export.module_tree``), the
  blocks as instances of their classes, and attaches to the root and to each block what its
  graphs read besides parameters, buffers and submodules: the constants, the input guard of an
  export-captured module (``InputGuard`` from the copied ``fxopt.runtime.input_guard``, raising
  the copied ``fxopt.runtime.errors.InputError``), the scoped graph bodies and the regions
  (``CheckpointedRegion`` from the copied ``fxopt.runtime.regions``); ``forward`` is torch.fx's
  code generation of the root graph, which calls the blocks as submodules; ``__init__`` ends
  registering the root's call guard (``InlineGuard`` from the copied
  ``fxopt.runtime.inline_guard``), which refuses a hook, a replacement or another mode on a
  module the code runs inline;
- ``load(map_location)``: the class with ``state_dict.pt`` loaded (``weights_only=True``).

The module imports public torch modules only, and refuses to import (``ImportError`` saying what
to do) under a torch release other than the one it was generated with: torch.fx writes operators
by the names that release gives them. ``FXOPT_ALLOW_OTHER_TORCH=1`` loads it anyway.

Names are described in ``fxopt.export.names``, the tree in ``fxopt.export.module_tree``.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import keyword
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxopt.core import meta_keys
from fxopt.core.errors import ExportError
from fxopt.core.modules import reads_its_own_mode
from fxopt.graph.graphs import inlined_paths, recomputed_with_what_they_call
from fxopt.graph.train_eval import dispatch_to_method, eval_graph
from fxopt.export.blocks import (
    graph_modules,
    own_graphs,
    input_names,
    renamed,
    shared_input_names,
)
from fxopt.export.module_tree import TreeWriter, called_modules
from fxopt.export.names import Imports
from fxopt.runtime.inline_guard import InlineGuard
from fxopt.runtime.input_guard import InputGuard
from fxopt.runtime.boxed import boxed_graph
from fxopt.runtime.regions import CheckpointedRegion

# The method an exported module runs in eval mode when its forward depends on self.training
# (see fxopt.graph.train_eval): the eval-mode graph, generated like forward.
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


def _attach(path: str, gm: fx.GraphModule, tree: TreeWriter, classes: _Classes) -> int:
    """Emit what ``gm``'s graphs read that is no parameter, buffer or submodule, on the module
    at ``path`` of the exported tree (the root or a block): tracer constants, the input guard of
    an export-captured module, the bodies of torch.export's scoped calls and checkpointed regions.
    Returns the number of regions."""
    attributes = _attributes(gm)
    regions = {t: v for t, v in attributes.items() if isinstance(v, CheckpointedRegion)}
    known = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    for target, value in attributes.items():
        if isinstance(value, (nn.Module, CheckpointedRegion)) or id(value) in known:
            continue
        if isinstance(value, InputGuard):
            code = _guard_source(value, tree.imports, target)
        elif isinstance(value, torch.Tensor):
            code = tree.constant(value, _full(path, target))
        else:
            raise ExportError(f"cannot export: the graph reads {target!r}, a "
                              f"{type(value).__name__}", where=f"attribute {_full(path, target)}",
                              hint="only tensors, parameters, buffers and modules can be exported")
        tree.lines.append(_setattr(path, target, code))
    for target, graph_body in _graph_bodies(gm, attributes).items():
        body = classes.add("_GraphBody", "A graph called in a scope (torch.export's scoped "
                           "calls).", _methods(graph_body.graph, None, tree.imports,
                                               f"body {_full(path, target)}"))
        tree.lines.append(_setattr(path, target, f"{body}()"))
    for target, region in regions.items():
        where = f"region {_full(path, target)}"
        if region.targets is None:
            raise ExportError(f"cannot export {where}: it holds its own state (an optimized "
                              "module saved by fxopt 0.1)", where=where,
                              hint="optimize the model again with this fxopt, then export it")
        tree.lines.append(_setattr(path, target, _region_source(region, classes, tree.imports,
                                                                where)))
    return len(regions)


# The graphs of a region (fxopt.runtime.regions.CheckpointedRegion), by constructor argument.
_REGION_GRAPHS = {"forward": ("_RegionForward", "The forward of a selective checkpointed region: "
                              "its body, also returning the outputs it keeps for backward."),
                  "recompute": ("_RegionRecompute", "What backward recomputes of a checkpointed "
                                "region: its body without the nodes whose outputs it keeps, "
                                "BatchNorm over scratch statistics.")}


def _region_source(region: CheckpointedRegion, classes: _Classes, imports: Imports,
                   where: str) -> str:
    """The constructor call that rebuilds ``region`` from code-only classes of its graphs."""
    methods = _methods(region.body.graph, None, imports, where)
    if region.boxed:  # what the region runs with grad disabled: inputs freed at their last use
        methods += "\n\n" + imports.forward_source(boxed_graph(region.body.graph),
                                                    f"{where} (boxed)", name="boxed_forward")
    body = classes.add("_RegionBody", "The body of a checkpointed region: code run over the "
                       "state its call site passes.", methods)
    arguments = [f"{body}()", f"selective={bool(region.selective)!r}",
                 f"targets={region.targets!r}"]
    for argument, (name, doc) in _REGION_GRAPHS.items():
        graph_module = getattr(region, argument)
        if graph_module is region.body:
            arguments.append(f"{argument}={body}()")
        elif graph_module is not None:
            code = _methods(graph_module.graph, None, imports, f"{where} ({argument})")
            arguments.append(f"{argument}={classes.add(name, doc, code)}()")
    arguments += [f"random={bool(region.random)!r}", f"shield={bool(region.shield)!r}",
                  f"boxed={bool(region.boxed)!r}"]
    return f"{imports.reference(type(region), where)}({', '.join(arguments)})"


def _full(path: str, target: str) -> str:
    return f"{path}.{target}" if path else target


def _setattr(path: str, target: str, code: str) -> str:
    """The line of ``__init__`` that sets the plain attribute ``target`` of the module at
    ``path`` to ``code``'s value."""
    owner, _, name = _full(path, target).rpartition(".")
    owner_expr = f"self.get_submodule({owner!r})" if owner else "self"
    return f"object.__setattr__({owner_expr}, {name!r}, {code})"


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


class _Classes:
    """The code-only classes of the generated module, one per distinct code: blocks (or bodies)
    that compute the same share one. Each is named after what it is, made unique."""

    def __init__(self, taken: set[str]):
        self.sources: list[str] = []
        self._taken = set(taken)
        self._by_code: dict[str, str] = {}

    def add(self, name: str, doc: str, methods: str) -> str:
        """The class whose methods are ``methods`` (indented for a class), written if new."""
        if methods not in self._by_code:
            numbered = (f"{name}_{i}" for i in itertools.count(1))
            unique = next(n for n in itertools.chain([name], numbered) if n not in self._taken)
            self._taken.add(unique)
            self._by_code[methods] = unique
            self.sources.append(f'class {unique}(torch.nn.Module):\n    """{doc}"""\n\n'
                                f"{methods}\n")
        return self._by_code[methods]


def _methods(graph: fx.Graph, in_eval: fx.Graph | None, imports: Imports, where: str) -> str:
    """``forward`` from ``graph``'s generated code; with ``in_eval`` (the eval-mode graph of a
    module whose forward depends on ``self.training``) also ``EVAL_METHOD`` from its code, which
    ``forward`` returns when the module is not in training mode."""
    if in_eval is None:
        return imports.forward_source(graph, where)
    return "\n\n".join([
        imports.forward_source(dispatch_to_method(graph, EVAL_METHOD), where),
        imports.forward_source(in_eval, f"{where} (eval mode)", name=EVAL_METHOD)])


def _block_classes(blocks: list[tuple[str, fx.GraphModule]], classes: _Classes,
                   imports: Imports) -> dict[int, str]:
    """id of each block -> the class written for it (``fxopt.export.blocks``): blocks whose code
    is the same once their inputs are named by position share one, which names each input as
    all of them do where they agree."""
    groups: dict[str, list[tuple[str, fx.GraphModule]]] = {}
    for path, block in blocks:
        positional = [f"input_{i}" for i in range(len(input_names(block.graph)))]
        groups.setdefault(_block_methods(path, block, positional, imports), []).append(
            (path, block))
    names: dict[int, str] = {}
    for members in groups.values():
        path, block = members[0]
        inputs = shared_input_names([b.graph for _, b in members])
        paths = ", ".join(p for p, _ in members[:3]) + (", ..." if len(members) > 3 else "")
        name = classes.add(python_identifier(type(block).__name__),
                           f"The code of block{'s' if len(members) > 1 else ''} {paths}; the "
                           "model's __init__ gives each its parameters, buffers and submodules.",
                           _block_methods(path, block, inputs, imports))
        names.update((id(b), name) for _, b in members)
    return names


def _block_methods(path: str, block: fx.GraphModule, inputs: list[str], imports: Imports) -> str:
    graphs = [renamed(graph, path, inputs) for graph in own_graphs(block)]
    return _methods(graphs[0], graphs[1] if len(graphs) > 1 else None, imports, f"block {path}")


def _attributes(gm: fx.GraphModule) -> dict[str, Any]:
    """target -> value of every attribute ``gm``'s graphs read."""
    return {n.target: operator.attrgetter(n.target)(gm) for graph in own_graphs(gm)
            for n in graph.find_nodes(op="get_attr")}


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


def _inline_guard(gm: fx.GraphModule, imports: Imports) -> str | None:
    """The ``__init__`` line registering the root's call guard (``InlineGuard``): the modules the
    generated code runs inline (none under a module it calls as a plain module, whose own
    ``forward`` calls its submodules), each with the path of the code that runs it where its mode
    matters, and the modules its regions recompute (and those they call). None when there are
    none."""
    trace = gm.meta.get(meta_keys.TRACE)
    moded = {entry[0] for entry in gm.meta.get(meta_keys.INLINED, ()) if entry[3:4] == (True,)}
    moded.update(getattr(trace, "mode_dependent_modules", ()))
    inlined = {path: runner if path in moded or reads_its_own_mode(gm.get_submodule(path))
               else None for path, runner in inlined_paths(gm).items()}
    recomputed = tuple(sorted(recomputed_with_what_they_call(gm)))
    if not inlined and not recomputed:
        return None
    guard = imports.reference(InlineGuard, "the call guard")
    return f"self.register_forward_pre_hook({guard}(self, {inlined!r}, {recomputed!r}))"


def generate(gm: fx.GraphModule, class_name: str) -> Generated:
    """The source of ``model.py`` for ``gm`` and what it needs (see the module docstring)."""
    imports = Imports()
    classes = _Classes({class_name})
    modules = graph_modules(gm)
    called: set[int] = set()
    for _, module in modules:  # a region's body reads the state by its path from the root
        bodies = [v.body.graph for v in _attributes(module).values()
                  if isinstance(v, CheckpointedRegion)]
        called |= called_modules(module, own_graphs(module)) | called_modules(gm, bodies)
    tree = TreeWriter(imports, called, _block_classes(modules[1:], classes, imports))
    tree.module(gm)
    regions = sum(_attach(path, module, tree, classes) for path, module in modules)
    forward = _methods(gm.graph, eval_graph(gm), imports, "forward")
    init = ["    def __init__(self):", "        super().__init__()"]
    if tree.constants:
        init.append("        _constants = torch.load(_HERE / 'constants.pt', weights_only=True)")
    init += ["        " + line for line in tree.lines]
    guard = _inline_guard(gm, imports)
    if guard:
        init.append("        " + guard)
    needs = f" and {', '.join(imports.needs)}" if imports.needs else ""
    source = "\n".join([
        f'"""{class_name} as optimized by fxopt, written as plain PyTorch (needs torch'
        f'{needs}).\n\nmodel = load()  # or {class_name}() then load_state_dict(...)\n"""\n',
        HEADER, TORCH_CHECK.format(version=str(torch.__version__), allow=ALLOW_OTHER_TORCH),
        *imports.lines,
        *(f"{name} = {expr}" for name, expr in imports.fx_globals.items()), "",
        f"__all__ = [{class_name!r}, 'load']", "", "", *classes.sources,
        f"class {class_name}(torch.nn.Module):",
        f'    """{class_name} as optimized by fxopt; weights: load() or load_state_dict()."""\n',
        *init, "", forward, "", "",
        "def load(map_location='cpu'):",
        f'    """A {class_name} with the exported weights (state_dict.pt), built on '
        'map_location\n    (whatever the default device is)."""',
        "    with torch.device(map_location):",
        f"        model = {class_name}()",
        "    state = torch.load(_HERE / 'state_dict.pt', map_location=map_location, "
        "weights_only=True)",
        "    model.load_state_dict(state)",
        "    return model.to(map_location)", ""])
    return Generated(source, class_name, dict(tree.constants), dict(imports.runtime_files),
                     list(imports.needs), regions)
