"""One GraphModule for a model whose Python ``forward`` depends on ``self.training``.

torch.fx records one path through ``forward``: code such as ``if self.training: aux = ...``
(GoogLeNet, Inception), ``F.dropout(x, p, self.training)`` or torchvision's
``stochastic_depth(x, p, mode, self.training)`` (EfficientNet, ConvNeXt, Swin) is frozen in the
mode the model was traced in. fxopt therefore traces such a model twice, all modules in train mode
and all in eval mode, and when the two graphs differ the optimized module keeps both: its graph is
the train-mode graph (the one the passes rewrite, since training is where memory runs out), and
its generated ``forward`` starts with ``if not self.training: return fxopt_eval_forward(self,
...)``, which runs the untouched eval-mode graph on the same submodules, parameters and buffers.

The dispatch lives in the graph's code generator (like torch.fx's own pytree code generator), so
it survives ``recompile()`` and every pass that keeps ``graph._codegen`` when it builds a new graph.
Tracing the optimized module again (optimizing it twice) sees ordinary Python and re-creates the
dispatch. Leaf modules (BatchNorm, Dropout, opaque fallbacks) check their own ``training`` flag
when they run, so they never need this.

Not handled: pickling the module with ``torch.save(module)``, which would re-trace one path of its
code on load and lose the eval-mode graph (``fxopt.graph.pickling`` refuses it), and a
model whose non-leaf modules are left in mixed modes on purpose: the train-mode graph is the one
with every module in train mode.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import fx

from fxopt.core.dropouts import drops_nothing
from fxopt.core.errors import TraceError
from fxopt.core.meta_keys import module_stack
from fxopt.core.modules import code_only_module, deepcopy_keeping_hooks, set_instance_method
from fxopt.core.torch_private import CodeGen, codegen_of, has_plain_codegen
from fxopt.runtime.eval_forward import EvalForward

_GLOBAL_NAME = "fxopt_eval_forward"


class ModeDispatchCodeGen(CodeGen):
    """Generates ``forward`` with an eval-mode early return in front of the train-mode body.

    The early return calls the global ``fxopt_eval_forward(self, ...)``, or with ``method`` set
    (an exported module, which has no fxopt to import) ``self.<method>(...)``.
    """

    def __init__(self, eval_forward: EvalForward, *, method: str | None = None):
        super().__init__()
        self.eval_forward = eval_forward
        self.method = method

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [] if self.method else [(_GLOBAL_NAME, self.eval_forward)]

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **kwargs: Any) -> str:
        head = super().gen_fn_def(free_vars, maybe_return_annotation, **kwargs)
        # free_vars entries may carry annotations and defaults ("x: torch.Tensor = None")
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars]
        call = (f"self.{self.method}({', '.join(names[1:])})" if self.method
                else f"{_GLOBAL_NAME}({', '.join(names)})")
        return f"{head}\n    if not self.training:\n        return {call}"


def same_graph(a: fx.Graph, b: fx.Graph, root: torch.nn.Module) -> bool:
    """Whether two traces of one module recorded the same computation.

    Tracer-made constants (``_tensor_constant0`` vs ``_tensor_constant1``) compare by value,
    the bodies of higher-order operators (torch.export's ``submod_1`` vs ``submod_2``) by their
    graphs, and two dropouts that drop nothing (``drops_nothing``) by their input alone.
    """
    return _same_graph_in(a, b, root, root)


def _same_graph_in(a: fx.Graph, b: fx.Graph, root_a: torch.nn.Module,
                   root_b: torch.nn.Module) -> bool:
    """``same_graph`` for graphs whose attributes live on two modules (two bodies)."""
    nodes_a, nodes_b = list(a.nodes), list(b.nodes)
    if len(nodes_a) != len(nodes_b):
        return False
    index = {}
    for i, (x, y) in enumerate(zip(nodes_a, nodes_b)):
        index[x], index[y] = i, i
        if x.op != y.op or not _same_target(x, y, root_a, root_b):
            return False
        if drops_nothing(x) and drops_nothing(y):
            if index.get(x.args[0], x.args[0]) != index.get(y.args[0], y.args[0]):
                return False
            continue
        mapped = [fx.node.map_arg((n.args, n.kwargs), lambda m: ("node", index[m]))
                  for n in (x, y)]
        try:
            if mapped[0] != mapped[1]:
                return False
        except RuntimeError:  # tensors among the args do not compare as one bool
            return False
    return True


def _same_target(x: fx.Node, y: fx.Node, root_a: torch.nn.Module,
                 root_b: torch.nn.Module) -> bool:
    if x.op != "get_attr":
        return x.target == y.target
    if x.target == y.target and root_a is root_b:
        return True
    try:
        values = [operator.attrgetter(x.target)(root_a), operator.attrgetter(y.target)(root_b)]
    except AttributeError:
        return False
    if all(isinstance(v, fx.GraphModule) for v in values):
        return _same_graph_in(values[0].graph, values[1].graph, *values)
    return (all(isinstance(v, torch.Tensor) for v in values)
            and values[0].shape == values[1].shape and values[0].dtype == values[1].dtype
            and bool(torch.equal(values[0], values[1])))


def modules_the_mode_changes(train: fx.Graph, evaluation: fx.Graph) -> tuple[str, ...]:
    """The paths of the modules (as ``nn_module_stack`` names them, the root excluded) that
    compute differently in train and in eval mode, read off a trace with every module in train
    mode and one in eval mode: those whose own operations differ (a Dropout's, a BatchNorm's, a
    stochastic depth or a branch of the user's that reads ``self.training``), or which run other
    submodules, or in another order. A container whose submodules alone differ (a Sequential of
    blocks, each of which a graph may call in its own mode) is not one: each submodule that
    differs is listed itself. Coarse where it errs: tensors a ``get_attr`` node reads are not
    compared, and a submodule run twice in a row reads as run once."""
    ops_train, ops_eval = _ops_by_module(train), _ops_by_module(evaluation)
    return tuple(sorted(path for path in ops_train.keys() | ops_eval.keys()
                        if ops_train.get(path) != ops_eval.get(path)))


def _ops_by_module(graph: fx.Graph) -> dict[str, list[tuple]]:
    """Module path -> what it runs, in order: its own operations with their arguments (a node
    argument read as its position among that module's own operations, or ``"outside"``), and
    ``("in", child)`` where a submodule runs."""
    ops: dict[str, list[tuple]] = {}
    position: dict[str, dict[fx.Node, int]] = {}
    for node in graph.nodes:
        stack = [path for path, _kind in module_stack(node) if path]
        for depth, path in enumerate(stack):
            seen = ops.setdefault(path, [])
            if depth + 1 < len(stack):
                key: tuple = ("in", stack[depth + 1])
                if not seen or seen[-1] != key:
                    seen.append(key)
                continue
            local = position.setdefault(path, {})

            def ref(arg: fx.Node, local: dict = local) -> tuple:
                return ("node", local.get(arg, "outside"))

            if drops_nothing(node):  # one computation in either mode
                key = ("drops nothing", fx.node.map_arg(node.args[0], ref))
            elif node.op == "get_attr":
                key = ("get_attr",)
            else:
                key = (node.op, node.target, _comparable(fx.node.map_arg(
                    (node.args, node.kwargs), ref)))
            local[node] = len(local)
            seen.append(key)
    return ops


def _comparable(value: Any) -> Any:
    """``value`` with tensors (which do not compare as one bool) read as their shape and dtype."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_comparable(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _comparable(v)) for k, v in value.items())
    return value


def install_eval_graph(gm: fx.GraphModule, eval_graph: fx.Graph) -> None:
    """Make ``gm``'s forward run ``eval_graph`` whenever ``gm.training`` is False."""
    if not has_plain_codegen(gm.graph):  # e.g. pytree-flattened arguments
        raise TraceError(
            f"{type(gm).__name__}.forward depends on self.training and its traced code uses "
            f"{type(codegen_of(gm.graph)).__name__}, which fxopt cannot combine with a per-mode graph",
            where="forward", hint="pass plain tensors as example inputs, or move the "
            "self.training branch into a submodule and list it in leaf_modules=(...)")
    eval_module = code_only_module(eval_graph, gm, f"{type(gm).__name__}Eval")
    gm.graph.set_codegen(ModeDispatchCodeGen(EvalForward(eval_module)))
    gm.recompile()
    set_instance_method(gm, "__deepcopy__", _deepcopy_with_eval_attributes)


def replace_eval_graph(gm: fx.GraphModule, graph: fx.Graph) -> None:
    """Make ``gm``'s mode dispatch run ``graph``, an edited copy of its eval-mode graph."""
    method = codegen_of(gm.graph).method
    eval_module = code_only_module(graph, gm, f"{type(gm).__name__}Eval")
    gm.graph.set_codegen(ModeDispatchCodeGen(EvalForward(eval_module), method=method))
    gm.recompile()


def _deepcopy_with_eval_attributes(self: fx.GraphModule, memo: dict) -> fx.GraphModule:
    """torch.fx's deep copy keeps only the attributes the train-mode graph reads; the plain
    attributes only the eval-mode graph reads (a higher-order op's body, a constant) come too."""
    copied = deepcopy_keeping_hooks(self, memo)
    graph = eval_graph(self)
    for node in graph.find_nodes(op="get_attr") if graph is not None else ():
        owner_path, _, name = node.target.rpartition(".")
        owner = copied.get_submodule(owner_path)
        if not hasattr(owner, name):
            value = operator.attrgetter(node.target)(self)
            object.__setattr__(owner, name, copy.deepcopy(value, memo))
    return copied


def has_eval_graph(gm: fx.GraphModule) -> bool:
    return isinstance(codegen_of(gm.graph), ModeDispatchCodeGen)


def eval_module_on(gm: fx.GraphModule) -> fx.GraphModule | None:
    """The eval-mode graph as a GraphModule over ``gm``'s own state (for analyses that run it
    node by node; the dispatching forward itself holds code only)."""
    graph = eval_graph(gm)
    return None if graph is None else fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Eval")


def eval_graph(gm: fx.GraphModule) -> fx.Graph | None:
    """The eval-mode graph ``gm`` dispatches to, or None when it has one graph for both."""
    return dispatched_eval_module(gm.graph).graph if has_eval_graph(gm) else None


def dispatched_eval_module(graph: fx.Graph) -> fx.GraphModule | None:
    """The eval-mode module ``graph``'s generated code dispatches to (it holds the constants the
    eval-mode graph reads), or None when ``graph`` has no mode dispatch."""
    codegen = codegen_of(graph)
    return codegen.eval_forward.eval_module if isinstance(codegen, ModeDispatchCodeGen) else None


def dispatch_to_method(graph: fx.Graph, method: str) -> fx.Graph:
    """A copy of ``graph`` whose code's eval-mode early return calls ``self.<method>``."""
    copied = fx.Graph()
    output = copied.graph_copy(graph, {})
    copied.output(output)
    copied.set_codegen(ModeDispatchCodeGen(codegen_of(graph).eval_forward, method=method))
    return copied
