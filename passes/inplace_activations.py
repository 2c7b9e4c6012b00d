"""Make activations in-place where that is safe and actually saves memory.

Rewrites ReLU, ReLU6, LeakyReLU, Hardtanh, ELU, SELU, CELU, SiLU, Hardswish, Hardsigmoid and
Mish -- module calls, ``F.relu(x)``, ``torch.relu(x)``, ``x.relu()`` -- to their in-place form,
at one call site at a time (a module object used at several call sites is never flipped; the call
site becomes ``F.<act>(x, ..., inplace=True)`` and the module object is left alone). On ATen
graphs (``capture="export"``) the functional overload becomes its in-place overload with the same
arguments (``aten.relu.default`` -> ``aten.relu_.default``; table ``_ATEN_ACTIVATIONS``, which also
has ``aten.gelu`` -> ``aten.gelu_``: autograd says ``gelu_``, like ``relu6_``, saves a copy of its
input, so only ``train=False`` rewrites it).

A call site is rewritten only when all of these hold:

- it is not a call of a module with hooks (``fxopt.core.modules.has_hooks``: forward pre/post
  hooks, backward pre/post hooks): the functional form would no longer fire them;
- its input is computed inside the graph: not a graph input, parameter, buffer or constant, nor a
  view of one (decided from storage identity of the fake tensors in ``meta["val"]``);
- neither its input nor any alias of it is the output of, or an argument to, a call of a module
  with hooks: a hook may keep what it sees (feature extraction), and autograd refuses in-place
  writes to the outputs of a module with full backward hooks;
- no other node reads the input, or any alias of it, after this one;
- ``train=True`` (default): no other node's backward needs the overwritten value (the saved
  tensor analysis, obtained from autograd itself), and the in-place form's own backward saves only
  its result -- asked of autograd once per (op, options): ``hardtanh_``, ``silu_``, ``mish_``,
  ``hardswish_`` and ``hardsigmoid_`` save a *copy* of their input, so in-place would save nothing,
  and ``leaky_relu_``/``elu_`` with a negative slope cannot run backward at all; those stay.
- ``train=False`` is the looser inference rule: the model is only valid under ``torch.no_grad()``
  or ``eval`` use without backward; autograd raises (never silently miscomputes) if it is trained.

Which call sites may be rewritten is decided by ``fxopt.planning.inplace``; this pass finds the
in-place form of each activation call and edits the graph.

Not handled: activations inside opaque leaf modules, and user modules subclassing the listed
ones (their forward may differ). Process-wide module hooks
(``torch.nn.modules.module.register_module_forward_hook`` & co.) are not considered: a rewritten
call site is no longer a module call they see.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.core.modules import call_hooks
from fxopt.planning.inplace import InplacePlanner
from fxopt.rewrite.pass_base import PassResult, graph_edited, mark_new

PASS_NAME = "inplace_activations"

# module type -> (functional form, the module attributes it takes as positional args after x)
_MODULE_FORMS: dict[type, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    nn.ReLU: (F.relu, ()),
    nn.ReLU6: (F.relu6, ()),
    nn.LeakyReLU: (F.leaky_relu, ("negative_slope",)),
    nn.Hardtanh: (F.hardtanh, ("min_val", "max_val")),
    nn.ELU: (F.elu, ("alpha",)),
    nn.SELU: (F.selu, ()),
    nn.CELU: (F.celu, ("alpha",)),
    nn.SiLU: (F.silu, ()),
    nn.Hardswish: (F.hardswish, ()),
    nn.Hardsigmoid: (F.hardsigmoid, ()),
    nn.Mish: (F.mish, ()),
}
_FUNCTIONAL = {form for form, _ in _MODULE_FORMS.values()}
_TORCH_TO_INPLACE = {torch.relu: torch.relu_, torch.selu: torch.selu_, torch.celu: torch.celu_}
_METHODS = {"relu", "selu", "celu"}
# ATen graphs (torch.export): aten.<name>.default -> aten.<name>_.default, the same arguments
_ATEN_ACTIVATIONS = ("relu", "relu6", "leaky_relu", "hardtanh", "elu", "selu", "celu", "silu",
                     "hardswish", "hardsigmoid", "mish", "gelu")
_TORCH_TO_INPLACE.update({getattr(torch.ops.aten, name).default:
                          getattr(torch.ops.aten, f"{name}_").default
                          for name in _ATEN_ACTIVATIONS})


def _rewrite_of(gm: fx.GraphModule, node: fx.Node) -> tuple[Callable, tuple, dict] | None:
    """The in-place call (target, args, kwargs) equivalent to ``node``, or None if not an activation."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        form = _MODULE_FORMS.get(type(module))
        if form is None or getattr(module, "inplace", False) or node.kwargs:
            return None
        fn, attrs = form
        return fn, (node.args[0], *(getattr(module, a) for a in attrs)), {"inplace": True}
    if node.op == "call_function" and node.target in _FUNCTIONAL:
        if _bound_arg(node, "inplace", node.target) is True:
            return None
        kwargs = dict(node.kwargs)
        kwargs["inplace"] = True
        positional = _positional_without_inplace(node)
        return node.target, positional, kwargs
    if node.op == "call_function" and node.target in _TORCH_TO_INPLACE:
        return _TORCH_TO_INPLACE[node.target], node.args, dict(node.kwargs)
    if node.op == "call_method" and node.target in _METHODS:
        return operator.methodcaller(node.target + "_"), node.args, dict(node.kwargs)
    return None


def _bound_arg(node: fx.Node, name: str, fn: Callable) -> Any:
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    return bound.arguments.get(name)


def _positional_without_inplace(node: fx.Node) -> tuple:
    params = list(inspect.signature(node.target).parameters)
    if "inplace" in params and len(node.args) > params.index("inplace"):
        return tuple(node.args[: params.index("inplace")]) + tuple(
            node.args[params.index("inplace") + 1:])
    return tuple(node.args)


def inplace_activations(gm: fx.GraphModule, *, train: bool = True) -> PassResult:
    """Rewrite safe activation call sites to in-place; see the module docstring for the rules."""
    planner = InplacePlanner(gm, train=train)  # the decisions (fxopt.planning.inplace)
    rewritten, skipped = [], {}
    for node in list(gm.graph.nodes):
        if node in planner.hooked:
            module = gm.get_submodule(node.target)
            if type(module) in _MODULE_FORMS:
                skipped[node.name] = f"module has {' and '.join(call_hooks(module))}"
            continue
        rewrite = _rewrite_of(gm, node)
        if rewrite is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        target, args, kwargs = rewrite
        source = node.args[0]
        why_not = planner.why_not(node, source,
                                  (target, tuple(args[1:]), tuple(sorted(kwargs.items()))))
        if why_not:
            skipped[node.name] = why_not
            continue
        if isinstance(target, operator.methodcaller):
            with gm.graph.inserting_after(node):
                new = gm.graph.call_method(node.target + "_", tuple(args), kwargs)
        else:
            # aten.relu_.default is named relu_, as torch.export names its nodes
            name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
            with gm.graph.inserting_after(node):
                new = gm.graph.create_node("call_function", target, tuple(args), kwargs, name)
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        mark_new(new, PASS_NAME)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        planner.rewritten(node, new, source)
        rewritten.append(new.name)
    if rewritten:
        graph_edited(gm)
    return PassResult(gm, bool(rewritten), {"rewritten": len(rewritten), "sites": rewritten,
                                             "skipped": skipped})

