"""What sizes an exported program serves: ``constraints_of``, and batch 1 by a second trace.

``fxopt.capture.export_frontend`` exports forward with every dimension of every tensor input
dynamic (``Dim.AUTO``: a size stays symbolic unless forward's code fixes it). torch.export then
describes the calls its graph is valid for in three places: each input dimension is a fixed int
or a symbol (two dimensions with one symbol must be equal), each symbol has a range, and
``program._guards_code`` lists the conditions forward's code was traced under (``seq_len > 1`` from
a branch, a product of sizes two views agree on, ``min(512, seq_len) == seq_len`` from a
position table). ``constraints_of`` reads all three; the guard conditions become size
expressions (``fxopt.runtime.input_guard.evaluate``) the captured module checks on every call.

Sizes 0 and 1. torch.export traces a size of 0 or 1 apart from larger ones (broadcasting,
contiguity, ``if x.size(0) == 1``), so a graph traced with a batch of 4 says nothing about a batch
of 1: by default it even assumes sizes of at least 2 without recording why. fxopt exports with
``backed_size_oblivious`` (``fxopt.core.torch_private.size_oblivious_export``), under which every
decision on a size being 1 is recorded as a guard, and serves a batch of 1 only when a second
export with the batch dimensions (``batch_group``: dimension 0 of each input whose size is the
batch's) cut to 1 gives the same graph (``same_program``) for calls at batch 1. "The same" leaves
out what a trace records only where it is not known to be a no-op, so that one graph computes
both: ``aten.contiguous`` (a copy or not, as the tensor it gets needs), and a view, reshape,
expand or slice whose result has its input's shape at batch 1 (``position_ids.expand(batch,
-1)`` of a ``(1, T)`` tensor); and it compares the integers the graph computes from sizes by their value over the
input dimensions (the batch dimensions read as 1), not by which input a size was read from.
The captured module then checks "the first trace's conditions, or every batch dimension is 1
and the second trace's conditions" (``with_batch_of_one``); when the graphs differ, a batch of
1 is refused saying so (``without_batch_of_one``). Every other symbol serves sizes of at least
2 only (1 when the example had 1). Hugging Face language models with labels record
``labels.size(0) != 1`` (their loss calls ``.contiguous()`` on shifted labels, a copy only when
the batch is not 1): the second trace differs from the first by that one ``contiguous``, so
batch 1 is served. A model that branches on ``x.size(0) == 1`` records a different graph at
batch 1: refused.

Not handled (``constraints_of`` gives up; ``export_frontend`` then fixes the dimensions
``unusable_dims`` names and exports again): guards using functions other than min, max and
abs, and input sizes that are expressions of other sizes (``2 * s0``).
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx
from torch.export.graph_signature import InputKind

from fxopt.core.dropouts import drops_nothing
from fxopt.core.torch_private import UNSAFE_VIEW, export_guards
from fxopt.runtime.input_guard import TensorSpec, evaluate, reads

aten = torch.ops.aten

TRACED = "torch.export recorded this condition while tracing forward"
TRACED_AT_ONE = "recorded while tracing forward a second time, at batch 1"
ALL_OR_NONE = ("a batch of 1 is served when every batch dimension is 1, as in the second trace "
               "at batch 1")

# Operators whose result has the values of their input whatever the sizes: a trace records them
# only when they are not a no-op (``aten.contiguous`` copies a tensor that is not contiguous).
_VALUE_PRESERVING = frozenset({aten.contiguous.default})
# Operators that give back their input's values when the result has the input's shape.
_SAME_SHAPE_IS_IDENTITY = frozenset({aten.view.default, aten.reshape.default, *UNSAFE_VIEW,
                                     aten.expand.default, aten.slice.Tensor,
                                     aten.alias.default})


@dataclass
class Constraints:
    """The calls one exported program serves: each tensor input's fixed dims (int) or symbols
    (str), each symbol's (lowest, highest or None) size, and size expressions that must hold,
    each with why (``InputGuard``'s ``tensors``, ``ranges`` and ``checks``)."""

    specs: list[TensorSpec]
    ranges: dict[str, tuple[int, int | None]]
    checks: list[tuple[Any, str]] = field(default_factory=list)
    batch_of_one: bool = False  # whether a second trace added the calls with a batch of 1


class _Unsupported(Exception):
    pass


def constraints_of(program: Any, example: tuple[torch.Tensor, ...]) -> Constraints | None:
    """What ``program`` (exported with ``example`` as its flat tensor inputs) serves; None when
    fxopt cannot express it (a size that is an expression, a guard it cannot read)."""
    specs = _input_specs(program, len(example))
    guards = export_guards(program)
    if specs is None or guards is None:
        return None
    try:
        checks = [(parse_guard(code), TRACED) for code in guards]
    except _Unsupported:
        return None
    hints: dict[str, int] = {}
    for spec, t in zip(specs, example):
        for size, hint in zip(spec.dims, t.shape):
            if isinstance(size, str):
                hints[size] = hint
    exported = _ranges(program)
    ranges = {}
    for symbol, hint in hints.items():  # sizes 0 and 1 only where the example had them
        low, high = exported.get(symbol, (0, None))
        ranges[symbol] = (max(low, min(hint, 2)), high)
    return Constraints(specs, ranges, [c for c in checks if c[0] is not True])


def unusable_dims(program: Any, example: tuple[torch.Tensor, ...]) -> set[tuple[int, int]]:
    """The input dimensions (leaf, dim) that make ``constraints_of`` give up: a size that is an
    expression, or read by a guard ``parse_guard`` cannot read; every dimension when this
    torch keeps no guards."""
    every = {(leaf, dim) for leaf, t in enumerate(example) for dim in range(t.dim())}
    guards = export_guards(program)
    if guards is None:
        return every
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    users = [by_name[s.arg.name].meta["val"] for s in program.graph_signature.input_specs
             if s.kind == InputKind.USER_INPUT]
    bad = {(leaf, dim) for leaf, val in enumerate(users) for dim, size in enumerate(val.shape)
           if not (isinstance(size, int) or str(size).isdigit() or str(size).isidentifier())}
    for code in guards:
        try:
            parse_guard(code)
        except _Unsupported:
            bad |= {(int(leaf), int(dim)) for leaf, dim in
                    re.findall(r"L\[[^\]]+\]\[(\d+)\]\.size\(\)\[(\d+)\]", code)} or every
    return bad & every


def _input_specs(program: Any, count: int) -> list[TensorSpec] | None:
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    specs = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = by_name[spec.arg.name].meta["val"]
        dims = []
        for size in val.shape:
            text = str(size)
            if isinstance(size, int) or text.isdigit():  # a SymInt the trace fixed prints as one
                dims.append(int(text))
            elif text.isidentifier():
                dims.append(text)
            else:
                return None
        specs.append(TensorSpec(tuple(dims), val.dtype, val.device.type))
    return specs if len(specs) == count else None


def _ranges(program: Any) -> dict[str, tuple[int, int | None]]:
    ranges = {}
    for symbol, span in program.range_constraints.items():
        ranges[str(symbol)] = (_bound(span.lower, 0), _bound(span.upper, None))
    return ranges


def _bound(value: Any, unbounded: int | None) -> int | None:
    if not getattr(value, "is_finite", True):  # sympy's (and torch's integer) infinity
        return unbounded
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return unbounded


# ---------------------------------------------------------------------------------------------
# Guards as size expressions

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%", ast.Pow: "**"}
_COMPARE = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
            ast.GtE: ">="}
_CALLS = {"sym_min": "min", "Min": "min", "min": "min", "sym_max": "max", "Max": "max",
          "max": "max", "abs": "abs", "Abs": "abs"}


def parse_guard(code: str) -> Any:
    """``code`` (one of ``program._guards_code``) as a size expression; raises ``_Unsupported``
    for anything but sizes, strides and storage offsets of the inputs, int and float constants,
    arithmetic, comparisons, and/or/not, min, max and abs."""
    try:
        tree = ast.parse(code.strip(), mode="eval")
    except (SyntaxError, RecursionError) as error:
        raise _Unsupported(code) from error
    return _expr(tree.body)


def _expr(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
        return node.value
    if isinstance(node, ast.BoolOp):
        return ("and" if isinstance(node.op, ast.And) else "or", *map(_expr, node.values))
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.Not):
            return ("not", _expr(node.operand))
        if isinstance(node.op, ast.USub):
            return ("neg", _expr(node.operand))
        if isinstance(node.op, ast.UAdd):
            return _expr(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return (_BINARY[type(node.op)], _expr(node.left), _expr(node.right))
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        operands = [_expr(node.left), *map(_expr, node.comparators)]
        pairs = [(_COMPARE[type(op)], a, b)
                 for op, a, b in zip(node.ops, operands, operands[1:])]
        return pairs[0] if len(pairs) == 1 else ("and", *pairs)
    if isinstance(node, ast.Subscript):  # L['tensors'][i].size()[d] / .stride()[d]
        call, dim = node.value, _int(node.slice)
        if _is_method_call(call, ("size", "stride")):
            return ("size" if call.func.attr == "size" else "stride", _leaf(call.func.value), dim)
    if _is_method_call(node, ("storage_offset",)):
        return ("offset", _leaf(node.func.value))
    if isinstance(node, ast.Call) and not node.keywords:
        name = (node.func.attr if isinstance(node.func, ast.Attribute) else
                node.func.id if isinstance(node.func, ast.Name) else None)
        base = node.func.value if isinstance(node.func, ast.Attribute) else None
        if name in _CALLS and (base is None or (isinstance(base, ast.Name)
                                                and base.id in ("torch", "sympy", "math"))):
            return (_CALLS[name], *map(_expr, node.args))
    raise _Unsupported(ast.dump(node))


def _is_method_call(node: ast.AST, names: tuple[str, ...]) -> bool:
    return (isinstance(node, ast.Call) and not node.args and not node.keywords
            and isinstance(node.func, ast.Attribute) and node.func.attr in names)


def _leaf(node: ast.AST) -> int:
    """The flat input index of ``L['<name>'][<index>]``."""
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Subscript)
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "L"):
        return _int(node.slice)
    raise _Unsupported(ast.dump(node))


def _int(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise _Unsupported(ast.dump(node))


# ---------------------------------------------------------------------------------------------
# Batch 1


def batch_group(constraints: Constraints, example: tuple[torch.Tensor, ...]
                ) -> list[tuple[int, int]]:
    """The batch dimensions: (leaf, 0) of every input whose dimension 0 is dynamic and has the
    size of the first such input's, when that size is at least 2; else none."""
    group: list[tuple[int, int]] = []
    batch = None
    for index, (spec, t) in enumerate(zip(constraints.specs, example)):
        if not spec.dims or not isinstance(spec.dims[0], str):
            continue
        if batch is None:
            batch = t.shape[0]
            if batch < 2:
                return []
        if t.shape[0] == batch:
            group.append((index, 0))
    return group


def cut_to_one(example: tuple[torch.Tensor, ...], group: list[tuple[int, int]]
               ) -> tuple[torch.Tensor, ...]:
    """``example`` with every dimension of ``group`` cut to its first entry."""
    cut = list(example)
    for index, dim in group:
        cut[index] = cut[index].narrow(dim, 0, 1).clone()
    return tuple(cut)


def same_program(a: Any, b: Any, specs_a: list[TensorSpec], specs_b: list[TensorSpec],
                 ones: list[tuple[int, int]] = ()) -> bool:
    """Whether two exports of one forward (inputs as ``specs_a`` and ``specs_b`` say) recorded
    the same computation for calls whose dimensions ``ones`` (leaf, dim) are 1: the same inputs,
    outputs, and operators on the same arguments, with value-preserving operators left out
    (``_value_preserving``) and every integer the graph computes from sizes compared by its
    value, written over the input dimensions, not by how the trace computed it."""
    def kinds(specs: Any) -> list:
        return [(s.kind, s.target) for s in specs]

    signature_a, signature_b = a.graph_signature, b.graph_signature
    return (kinds(signature_a.input_specs) == kinds(signature_b.input_specs)
            and kinds(signature_a.output_specs) == kinds(signature_b.output_specs)
            and _same_graph(a.graph_module, b.graph_module, _dims_of(specs_a, ones),
                            _dims_of(specs_b, ones)))


def _dims_of(specs: list[TensorSpec], ones: list[tuple[int, int]]) -> dict[str, sympy.Expr]:
    """Each symbol of ``specs`` as the first input dimension that has it (the same name in two
    traces then means the same size of the same input), or 1 if one of ``ones`` has it."""
    dims: dict[str, sympy.Expr] = {}
    for leaf, spec in enumerate(specs):
        for dim, size in enumerate(spec.dims):
            if isinstance(size, str) and (size not in dims or (leaf, dim) in ones):
                dims[size] = (sympy.Integer(1) if (leaf, dim) in ones else
                              sympy.Symbol(f"input{leaf}_dim{dim}", integer=True))
    return dims


def _same_graph(a: fx.GraphModule, b: fx.GraphModule, dims_a: dict, dims_b: dict) -> bool:
    (nodes_a, seen_a), (nodes_b, seen_b) = _kept(a.graph, dims_a), _kept(b.graph, dims_b)
    if len(nodes_a) != len(nodes_b):
        return False
    index: dict[fx.Node, int] = {}

    def key(node: fx.Node, seen: dict) -> Any:
        while isinstance(node, fx.Node) and node in seen:  # a value-preserving operator's
            node = seen[node]                                # result is its input
        return ("node", index[node]) if isinstance(node, fx.Node) else node

    for i, (x, y) in enumerate(zip(nodes_a, nodes_b)):
        index[x], index[y] = i, i
        if x.op != y.op:
            return False
        if x.op == "get_attr":
            values = [operator.attrgetter(n.target)(m) for n, m in ((x, a), (y, b))]
            if all(isinstance(v, fx.GraphModule) for v in values):
                if not _same_graph(*values, dims_a, dims_b):
                    return False
            elif x.target != y.target:
                return False
        elif x.target != y.target:
            return False
        try:
            if (fx.node.map_arg((x.args, x.kwargs), lambda n: key(n, seen_a))
                    != fx.node.map_arg((y.args, y.kwargs), lambda n: key(n, seen_b))):
                return False
        except RuntimeError:  # tensors among the arguments do not compare as one bool
            return False
    return True


def _kept(graph: fx.Graph, dims: dict[str, sympy.Expr]
          ) -> tuple[list[fx.Node], dict[fx.Node, Any]]:
    """The nodes compared in order, and what each node left out stands for: its input (a
    value-preserving operator), or ("size", expression) or a constant for an integer computed
    from sizes (a trace may read a size from another input of that size, at another place, once
    more, or know it is 1)."""
    kept, seen = [], {}
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and _value_preserving(node, dims):
            seen[node] = node.args[0]
        elif node.op == "call_function" and isinstance(value, (torch.SymInt, torch.SymBool)):
            expr = _over_inputs(value, dims)
            if isinstance(expr, (int, bool)):  # equal to the constant the other trace recorded
                seen[node] = expr
            else:
                seen[node] = ("size", expr)
        else:
            kept.append(node)
    return kept, seen


def _over_inputs(value: Any, dims: dict[str, sympy.Expr]) -> Any:
    """A size (int or SymInt/SymBool) as an int, a bool or its expression over the input
    dimensions (``dims``)."""
    if isinstance(value, (int, bool)):
        return value
    expr = value.node.expr
    expr = expr.xreplace({s: dims.get(str(s), s) for s in expr.free_symbols})
    if expr.is_number:
        return bool(expr) if isinstance(value, torch.SymBool) else int(expr)
    return str(expr)


def _value_preserving(node: fx.Node, dims: dict[str, sympy.Expr]) -> bool:
    """Whether ``node`` gives back its input's values: ``aten.contiguous`` (a copy or not, as
    its input needs), a dropout that drops nothing (p 0, or not training), and a view, reshape,
    expand or slice to the shape its input has (for the calls compared: ``dims`` read as they
    say). Two traces of one forward may record such an operator in one and not the other, or
    with other arguments, for the same computation."""
    if node.target in _VALUE_PRESERVING:
        return True
    if drops_nothing(node):
        return True
    if node.target not in _SAME_SHAPE_IS_IDENTITY or not isinstance(node.args[0], fx.Node):
        return False
    out, given = node.meta.get("val"), node.args[0].meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor)):
        return False
    return (out.dim() == given.dim()
            and all(_over_inputs(a, dims) == _over_inputs(b, dims)
                    for a, b in zip(out.shape, given.shape)))


def with_batch_of_one(first: Constraints, at_one: Constraints, group: list[tuple[int, int]]
                      ) -> Constraints:
    """``first``'s calls, and the calls with every dimension of ``group`` 1 that ``at_one`` (the
    second trace's constraints) serves, when both traces recorded the same graph: ``first``'s
    checks hold unless every batch dimension is 1, ``at_one``'s (the batch read as 1) when it is,
    and a check both traces recorded holds always."""
    ones = [("==", ("size", leaf, dim), 1) for leaf, dim in group]
    all_one = ones[0] if len(ones) == 1 else ("and", *ones)
    ranges = dict(first.ranges)
    batch = {("size", leaf, dim) for leaf, dim in group}
    second = []
    for expr in as_checks(at_one):
        folded = _fold(expr, batch)
        if folded is not True and folded not in second:
            second.append(folded)
    checks = [(expr, why) if expr in second else (("unless", all_one, expr), why)
              for expr, why in first.checks]
    for leaf, dim in group:
        symbol = first.specs[leaf].dims[dim]
        low, high = ranges[symbol]
        ranges[symbol] = (min(low, 1), high)
        checks.append((("unless", all_one, (">=", ("size", leaf, dim), 2)), ALL_OR_NONE))
    both = {expr for expr, _ in first.checks}
    checks += [(("when", all_one, expr), TRACED_AT_ONE) for expr in second if expr not in both]
    return Constraints(first.specs, ranges, checks, batch_of_one=True)


def without_batch_of_one(first: Constraints, group: list[tuple[int, int]], why: str
                         ) -> Constraints:
    """``first``, refusing a batch of 1 because ``why`` (the second trace's verdict), rather
    than by the range every symbol without a second trace gets."""
    ranges = dict(first.ranges)
    checks = []
    for leaf, dim in group:
        symbol = first.specs[leaf].dims[dim]
        low, high = ranges[symbol]
        ranges[symbol] = (min(low, 1), high)
        checks.append(((">=", ("size", leaf, dim), 2), why))
    return Constraints(first.specs, ranges, checks + first.checks)


def _fold(expr: Any, ones: set[tuple]) -> Any:
    """``expr`` with the reads in ``ones`` replaced by 1, and evaluated when nothing else is
    read."""
    if not isinstance(expr, tuple):
        return expr
    if expr in ones:
        return 1
    if expr[0] in ("size", "stride", "offset"):
        return expr
    folded = (expr[0], *(_fold(arg, ones) for arg in expr[1:]))
    if reads(folded):
        return folded
    return evaluate(folded, {})


def as_checks(constraints: Constraints) -> list[Any]:
    """Every condition of ``constraints`` as a size expression: fixed dims, equal symbols,
    ranges and guards."""
    checks: list[Any] = []
    first: dict[str, tuple] = {}
    for leaf, spec in enumerate(constraints.specs):
        for dim, size in enumerate(spec.dims):
            read = ("size", leaf, dim)
            if isinstance(size, int):
                checks.append(("==", read, size))
            elif size in first:
                checks.append(("==", read, first[size]))
            else:
                first[size] = read
                low, high = constraints.ranges.get(size, (0, None))
                if low > 0:
                    checks.append((">=", read, low))
                if high is not None:
                    checks.append(("<=", read, high))
    return checks + [expr for expr, _ in constraints.checks]
