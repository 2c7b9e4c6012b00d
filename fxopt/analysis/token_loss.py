"""Find a language model's token-level cross-entropy on top of its vocabulary projection.

``find_token_losses(gm)`` returns every ``TokenLoss``: a scalar cross-entropy whose input is,
through a chain of ops this module can reproduce exactly, the output of a projection
``linear(hidden, W, b)`` (``W``: ``vocab x hidden``), and a reason for every cross-entropy it
does not take. Both graph levels are read:

- the loss: ``F.cross_entropy`` / ``nn.CrossEntropyLoss``, ``F.nll_loss`` / ``nn.NLLLoss`` of a
  ``log_softmax`` over the last dimension, and their ATen forms (``aten.cross_entropy_loss``,
  ``aten.nll_loss_forward`` / ``nll_loss`` / ``nll_loss_nd`` of ``aten._log_softmax`` or
  ``aten.log_softmax``), with ``reduction`` mean or sum, any ``ignore_index``, any
  ``label_smoothing``, no class weights, class-index targets, input ``(tokens, vocab)``;
- the chain from projection to loss: slices of the leading (token) dimensions, as Hugging Face's
  older causal shift ``logits[..., :-1, :]`` does; one flatten to ``(tokens, vocab)``
  (``view``/``reshape``/``flatten``); ``contiguous``/``clone``; upcasts (``.float()``,
  ``.to(dtype)``, ``aten.to``/``_to_copy``); multiplication or division by a Python number
  (final logit scaling) and ``tanh`` (Gemma 2's soft-cap ``tanh(x / cap) * cap``);
- the projection: ``nn.Linear`` calls without hooks, ``F.linear``/``aten.linear``,
  ``aten.addmm(b, h, W.t())``, and ``h @ W.t()`` in any spelling (``matmul``, ``mm``, ``@``,
  ``.T``, ``.t()``, ``transpose``, ``permute``), so tied embeddings (``h @ emb.weight.T``, a
  ``Linear`` sharing the embedding's Parameter) are found too.

Each site lists the *logits uses*: nodes outside the loss's path that read the projection or a
node of the chain (a returned ``logits``), and whether each only hands the value to the
graph's output (directly, or through a container such as Hugging Face's ``ModelOutput``).
Shape reads (``size``, ``sym_size``) and ``_assert_tensor_metadata`` checks that serve only the
loss's path belong to that path.

Pure: reads ``meta["val"]`` and the graph, edits nothing.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.analysis.reach import ancestors
from fxopt.core.modules import has_hooks
from fxopt.core.torch_private import (
    ASSERT_TENSOR_METADATA,
    LOG_SOFTMAX_PRIVATE,
    TO_COPY,
    UNSAFE_VIEW,
    argument_defaults,
)

aten = torch.ops.aten
_INT64_MAX = 2**63 - 1

ASSERT_OPS = ASSERT_TENSOR_METADATA
_SHAPE_FUNCTIONS = frozenset({aten.sym_size.int, aten.sym_numel.default})
_SHAPE_METHODS = frozenset({"size", "dim"})

_LINEAR = frozenset({F.linear, aten.linear.default})
_MATMUL = frozenset({operator.matmul, torch.matmul, torch.mm, aten.matmul.default,
                     aten.mm.default})
_ADDMM = frozenset({aten.addmm.default, torch.addmm})
_TANH = frozenset({torch.tanh, F.tanh, aten.tanh.default})
_MUL = frozenset({operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar})
_DIV = frozenset({operator.truediv, torch.div, torch.true_divide, aten.div.Tensor,
                  aten.div.Scalar})
_COPIES = frozenset({aten.clone.default, aten.contiguous.default, aten.alias.default,
                     torch.clone})
_FLATTENS = frozenset({aten.view.default, aten.reshape.default, *UNSAFE_VIEW,
                       aten.flatten.using_ints, torch.flatten, torch.reshape})
_TO = frozenset({aten.to.dtype, *TO_COPY, aten.to.dtype_layout})
_LOG_SOFTMAX = frozenset({F.log_softmax, torch.log_softmax, *LOG_SOFTMAX_PRIVATE,
                          aten.log_softmax.int})
_NLL = frozenset({F.nll_loss, aten.nll_loss.default, aten.nll_loss_nd.default,
                  aten.nll_loss_forward.default})
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_DTYPE_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                  "bfloat16": torch.bfloat16}


@dataclass
class TokenLoss:
    """One cross-entropy over a vocabulary projection, as ``passes.chunked_loss`` rewrites it."""

    loss: fx.Node                 # the scalar loss value (what the rewrite's call replaces)
    head: fx.Node                 # the projection
    hidden: fx.Node               # its input, (..., hidden)
    weight: fx.Node | str         # (vocab, hidden): a node, or the state name of a Linear's weight
    bias: fx.Node | str | None
    targets: fx.Node              # (tokens,) class indices
    path: list[fx.Node]           # head ... loss: the nodes the loss alone needs, in graph order
    chain: list[fx.Node]          # the nodes between head and loss input the logits pass through
    steps: list[tuple]            # what each chain node does (``_walk_chain``)
    transforms: tuple             # element-wise ops on the logits (runtime.chunked_loss)
    row_slices: tuple             # (dim, start, stop, step) on the logits' leading dimensions
    ignore_index: int
    label_smoothing: float
    reduction: str
    tokens: int                   # rows of the projection's output
    vocab: int
    hidden_size: int
    itemsize: int                 # bytes per element of the loss's logits
    # (a node of head + chain, a node outside the path that reads it, output-bound?)
    logits_uses: list[tuple[fx.Node, fx.Node, bool]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.loss.name

    def transforms_to(self, node: fx.Node) -> tuple | None:
        """The element-wise transforms from the projection's output to ``node`` (the head or a
        chain node); None when the logits are sliced or reshaped on the way."""
        if node is self.head:
            return ()
        found: list[tuple] = []
        for chain_node, step in zip(self.chain, self.steps):
            if step[0] != "transform":
                return None
            if step[1]:
                found.append(step[1])
            if chain_node is node:
                return tuple(found)
        return None


@dataclass
class Findings:
    sites: list[TokenLoss]
    refused: dict[str, str]       # loss node name -> why it is not a site


class _Refuse(Exception):
    pass


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node: fx.Node) -> tuple[int, ...]:
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        raise _Refuse(f"{node.name} has no tensor metadata")
    if not all(isinstance(s, int) for s in val.shape):
        raise _Refuse(f"{node.name} has a symbolic shape")
    return tuple(val.shape)


def _bind(fn: Any, node: fx.Node) -> dict[str, Any]:
    """Arguments of a call of ``fn`` (a Python function or an ATen overload) by name."""
    schema = argument_defaults(fn)
    if schema is not None:
        names, defaults = schema
        bound = dict(defaults)
        bound.update(zip(names, node.args))
        bound.update(node.kwargs)
        return bound
    signature = inspect.signature(fn)
    bound = signature.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def _function(node: fx.Node, targets: frozenset) -> bool:
    return node.op == "call_function" and node.target in targets


def _module(gm: fx.GraphModule, node: fx.Node, kind: type) -> nn.Module | None:
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if type(module) is kind else None


def is_shape_read(node: fx.Node) -> bool:
    return (_function(node, _SHAPE_FUNCTIONS) or _method(node, *_SHAPE_METHODS)
            or (node.op == "call_function" and node.target is getattr
                and node.args[1:] == ("shape",)))


def is_assert(node: fx.Node) -> bool:
    return _function(node, ASSERT_OPS)


# ---------------------------------------------------------------------------------------------
# The loss


@dataclass
class _Loss:
    value: fx.Node               # the scalar loss
    nodes: list[fx.Node]         # the loss op [, the getitem of its value]
    logits: fx.Node              # its (tokens, vocab) input: logits, or log-probabilities
    targets: fx.Node
    ignore_index: int
    label_smoothing: float
    reduction: str
    log_probs: bool = False       # nll_loss: its input is a log_softmax of the logits


def _loss_of(gm: fx.GraphModule, node: fx.Node) -> _Loss | None:
    """``node`` as a cross-entropy (None if it is none); ``_Refuse`` if one we cannot take."""
    if _function(node, frozenset({F.cross_entropy, aten.cross_entropy_loss.default})):
        args = _bind(node.target, node)
        names = ("input", "target") if node.target is F.cross_entropy else ("self", "target")
        options = _options(args, ce=True)
        return _Loss(node, [node], args[names[0]], args[names[1]], *options)
    module = _module(gm, node, nn.CrossEntropyLoss)
    if module is not None:
        if has_hooks(module):
            raise _Refuse(f"the loss module {node.target} has hooks")
        if module.weight is not None:
            raise _Refuse("the loss has class weights")
        if len(node.args) != 2 or node.kwargs:
            raise _Refuse("the loss module is called with other arguments")
        options = _options({"ignore_index": module.ignore_index, "reduction": module.reduction,
                            "label_smoothing": module.label_smoothing}, ce=True)
        return _Loss(node, [node], node.args[0], node.args[1], *options)
    nll = _module(gm, node, nn.NLLLoss)
    if _function(node, _NLL) or nll is not None:
        if nll is not None:
            if has_hooks(nll) or nll.weight is not None or len(node.args) != 2:
                raise _Refuse("the NLLLoss module has hooks, class weights or other arguments")
            logp, targets = node.args
            options = _options({"ignore_index": nll.ignore_index, "reduction": nll.reduction},
                               ce=False)
        else:
            args = _bind(node.target, node)
            logp, targets = args.get("input", args.get("self")), args["target"]
            options = _options(args, ce=False)
        nodes = [node]
        value = node
        if node.target is aten.nll_loss_forward.default:
            items = {u.args[1]: u for u in node.users
                     if u.op == "call_function" and u.target is operator.getitem}
            if set(items) != {0} or len(node.users) != 1:
                raise _Refuse("nll_loss_forward's total weight is read")
            value = items[0]
            nodes.append(value)
        if not isinstance(logp, fx.Node):
            raise _Refuse("nll_loss input is not a graph value")
        return _Loss(value, nodes, logp, targets, *options, log_probs=True)
    return None


def _options(args: dict[str, Any], ce: bool) -> tuple[int, float, str]:
    if args.get("weight") is not None:
        raise _Refuse("the loss has class weights")
    if args.get("size_average") is not None or args.get("reduce") is not None:
        raise _Refuse("the loss uses the deprecated size_average/reduce arguments")
    reduction = args.get("reduction", "mean")
    reduction = _REDUCTIONS.get(reduction, reduction) if isinstance(reduction, int) else reduction
    if reduction not in ("mean", "sum"):
        raise _Refuse(f"reduction {reduction!r}: per-token losses, not one scalar")
    ignore = args.get("ignore_index", -100)
    smoothing = args.get("label_smoothing", 0.0) if ce else 0.0
    if not isinstance(ignore, int) or isinstance(smoothing, fx.Node):
        raise _Refuse("ignore_index or label_smoothing is computed in the graph")
    return ignore, float(smoothing), reduction


def _log_softmax_of(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """(the logits, the cast it applies) when ``node`` is a log_softmax over the last
    dimension; None when it is no log_softmax."""
    if _method(node, "log_softmax"):
        args = dict(zip(("dim", "dtype"), node.args[1:]), **node.kwargs)
        source = node.args[0]
    elif _function(node, _LOG_SOFTMAX):
        args = _bind(node.target, node)
        source = args.get("input", args.get("self"))
    else:
        return None
    rank = len(_shape(node))
    dim = args.get("dim")
    if not isinstance(dim, int) or dim % rank != rank - 1:
        raise _Refuse("log_softmax is not over the last dimension")
    if not isinstance(source, fx.Node):
        raise _Refuse("log_softmax does not read a graph value")
    if args.get("half_to_float"):
        return source, ("to", torch.float32)
    if isinstance(args.get("dtype"), torch.dtype) and args["dtype"] != _val(source).dtype:
        return source, ("to", args["dtype"])
    return source, ()


# ---------------------------------------------------------------------------------------------
# The chain from the projection to the loss


def _transform_of(node: fx.Node, source: fx.Node) -> tuple | None:
    """The element-wise transform ``node`` applies to ``source`` (None: not one), as
    ``runtime.chunked_loss`` names them; ``()`` for a no-op."""
    in_val, out_val = _val(source), _val(node)
    if tuple(in_val.shape) != tuple(out_val.shape):
        return None
    dtype_in, dtype_out = in_val.dtype, out_val.dtype
    cast = () if dtype_in == dtype_out else ("to", dtype_out)
    if _function(node, _COPIES) or _method(node, "contiguous", "clone"):
        return ()
    if _function(node, _TO) or _method(node, "to", "type", *_DTYPE_METHODS):
        if not out_val.is_floating_point() or out_val.device != in_val.device:
            return None
        return cast
    if _function(node, _TANH) or _method(node, "tanh"):
        return ("tanh",) if not cast else None
    if _function(node, _MUL | _DIV) or _method(node, "mul", "div", "truediv"):
        others = [a for a in (*node.args, *node.kwargs.values()) if a is not source]
        if len(others) != 1 or isinstance(others[0], fx.Node) or not isinstance(
                others[0], (int, float)) or isinstance(others[0], bool) or cast:
            return None
        if node.kwargs.get("rounding_mode") is not None:
            return None
        divide = node.target in _DIV or node.target in ("div", "truediv")
        if divide and node.args[0] is not source:
            return None  # c / x
        return ("div" if divide else "mul", float(others[0]))
    return None


def _slices_of(node: fx.Node, source: fx.Node) -> tuple | None:
    """Slices of the leading dimensions ``node`` takes of ``source`` (None: not a slice)."""
    rank = len(_shape(source))
    if node.op == "call_function" and node.target is aten.slice.Tensor:
        args = _bind(node.target, node)
        dim, start, end, step = (args["dim"] % rank, args.get("start"), args.get("end"),
                                 args.get("step", 1))
        if any(isinstance(v, fx.Node) for v in (start, end, step)):
            raise _Refuse("a slice of the logits has computed bounds")
        if end is not None and end >= _INT64_MAX:
            end = None
        items = [(dim, start, end, step)]
    elif (node.op == "call_function" and node.target is operator.getitem
          and node.args[0] is source):
        index = node.args[1]
        index = index if isinstance(index, tuple) else (index,)
        if not all(i is Ellipsis or isinstance(i, slice) for i in index) or index.count(
                Ellipsis) > 1:
            return None
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = (*index[:at], *[slice(None)] * (rank - len(index) + 1), *index[at + 1:])
        items = []
        for dim, item in enumerate(index):
            if any(isinstance(v, fx.Node) for v in (item.start, item.stop, item.step)):
                raise _Refuse("a slice of the logits has computed bounds")
            items.append((dim, item.start, item.stop, item.step if item.step else 1))
    else:
        return None
    kept = []
    for dim, start, stop, step in items:
        if start in (None, 0) and stop is None and step == 1:
            continue
        if dim == rank - 1:
            raise _Refuse("the loss reads a slice of the vocabulary")
        kept.append((dim, start, stop, step))
    return tuple(kept)


def _is_flatten(node: fx.Node, source: fx.Node) -> bool:
    if not (_function(node, _FLATTENS) or _method(node, "view", "reshape", "flatten")):
        return False
    shape_in, shape_out = _shape(source), _shape(node)
    return len(shape_out) == 2 and shape_out[1] == shape_in[-1] and len(shape_in) >= 2


def _source(node: fx.Node) -> fx.Node | None:
    """The tensor a chain op reads (``2.0 * x`` reads ``x``)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    first = node.args[0]
    if (not isinstance(first, fx.Node) and len(node.args) == 2
            and isinstance(node.args[1], fx.Node) and node.target in _MUL):
        first = node.args[1]
    if not isinstance(first, fx.Node) or not isinstance(_val(first), torch.Tensor):
        return None
    return first


def _walk_chain(loss_input: fx.Node, log_probs: bool
                ) -> tuple[fx.Node, list[fx.Node], list[tuple]]:
    """From the loss's (tokens, vocab) input back to the node that produced the logits:
    (that node, the chain in graph order, what each chain node does: ``("transform", t)``,
    ``("slice", slices)``, ``("reshape",)`` or, with ``log_probs`` (an nll_loss), once
    ``("log_softmax", cast)``; nothing but slices and reshapes may follow the log_softmax)."""
    chain: list[fx.Node] = []
    steps: list[tuple] = []
    flattened = sliced = False
    found_log_softmax = not log_probs
    node = loss_input
    while True:
        if not found_log_softmax:
            found = _log_softmax_of(node)
            if found is not None:
                found_log_softmax = True
                steps.append(("log_softmax", found[1]))
                chain.append(node)
                node = found[0]
                continue
        source = _source(node)
        if source is None or not isinstance(_val(node), torch.Tensor):
            break
        if not flattened and _is_flatten(node, source):
            if len(_shape(source)) > 2:
                if sliced:
                    raise _Refuse("the loss slices the flattened logits")
                flattened = True
            steps.append(("reshape",))
        else:
            transform = _transform_of(node, source)
            found_slices = None if transform is not None else _slices_of(node, source)
            if transform is None and found_slices is None:
                break
            if transform and not found_log_softmax:
                raise _Refuse("the log-probabilities are transformed before the loss")
            sliced = sliced or bool(found_slices)
            steps.append(("transform", transform) if transform is not None
                         else ("slice", found_slices))
        chain.append(node)
        node = source
    if not found_log_softmax:
        raise _Refuse("nll_loss does not read a log_softmax of the logits")
    return node, chain[::-1], steps[::-1]


# ---------------------------------------------------------------------------------------------
# The projection


_TRANSPOSE_2D = frozenset({aten.t.default, torch.t, aten.numpy_T.default, aten.mT.default})


def _untransposed(node: Any) -> fx.Node | None:
    """``E`` when ``node`` is ``E`` transposed (2-D), else None."""
    if not isinstance(node, fx.Node) or len(_shape(node)) != 2:
        return None
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return None
    if _function(node, _TRANSPOSE_2D) or _method(node, "t"):
        return source
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        return source
    if _function(node, frozenset({aten.transpose.int, torch.transpose})) or _method(
            node, "transpose"):
        dims = {d % 2 for d in node.args[1:3]}
        return source if dims == {0, 1} else None
    if _function(node, frozenset({aten.permute.default, torch.permute})) or _method(
            node, "permute"):
        dims = node.args[1] if len(node.args) == 2 else node.args[1:]
        return source if [d % 2 for d in dims] == [1, 0] else None
    return None


def _projection(gm: fx.GraphModule, node: fx.Node
                ) -> tuple[fx.Node, fx.Node | str, fx.Node | str | None] | None:
    """(hidden, weight, bias) when ``node`` is ``hidden @ weight.T + bias``."""
    linear = _module(gm, node, nn.Linear)
    if linear is not None:
        if has_hooks(linear):
            raise _Refuse(f"the projection {node.target} has hooks")
        if len(node.args) != 1 or node.kwargs:
            return None
        bias = f"{node.target}.bias" if linear.bias is not None else None
        return node.args[0], f"{node.target}.weight", bias
    if _function(node, _LINEAR):
        args = _bind(node.target, node)
        source = args.get("input", args.get("self"))
        return source, args["weight"], args.get("bias")
    if _function(node, _MATMUL) or _method(node, "matmul", "mm", "__matmul__"):
        if len(node.args) != 2 or node.kwargs:
            return None
        weight = _untransposed(node.args[1])
        return (node.args[0], weight, None) if weight is not None else None
    if _function(node, _ADDMM):
        args = _bind(node.target, node)
        if args.get("beta", 1) != 1 or args.get("alpha", 1) != 1:
            return None
        weight = _untransposed(args["mat2"])
        bias = args.get("input", args.get("self"))
        if weight is None or not isinstance(bias, fx.Node) or len(_shape(bias)) != 1:
            return None
        return args["mat1"], weight, bias
    return None


# ---------------------------------------------------------------------------------------------
# Putting it together


def _size_reads(node: fx.Node, on_path: set[fx.Node]) -> list[fx.Node]:
    """``node`` and the size arithmetic after it when it reads a shape for the loss's path
    alone (``logits.shape[-1]`` in a reshape); else []."""
    if not is_shape_read(node):
        return []
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        found.append(current)
        for user in current.users:
            if user in on_path:
                continue
            if isinstance(_val(user), torch.Tensor) or user.op not in (
                    "call_function", "call_method"):
                return []
            stack.append(user)
    return found


def _output_bound(node: fx.Node) -> bool:
    """Whether ``node`` (a user of the logits) only hands them to the graph's output."""
    if node.op == "output":
        return True
    if node.op == "call_function" and isinstance(node.target, type) and node.users:
        return all(_output_bound(u) for u in node.users)
    return False


def _site(gm: fx.GraphModule, loss: _Loss) -> TokenLoss:
    logits_2d = _shape(loss.logits)
    if len(logits_2d) != 2:
        raise _Refuse("the loss's input is not (tokens, vocab)")
    targets = loss.targets
    if not isinstance(targets, fx.Node):
        raise _Refuse("the targets are not a graph value")
    target_val = _val(targets)
    if (not isinstance(target_val, torch.Tensor) or target_val.is_floating_point()
            or _shape(targets) != logits_2d[:1]):
        raise _Refuse("the targets are not one class index per token")
    head, chain, steps = _walk_chain(loss.logits, loss.log_probs)
    transforms = tuple(step[1] for step in steps
                       if step[0] in ("transform", "log_softmax") and step[1])
    slices = tuple(item for step in steps if step[0] == "slice" for item in step[1])
    found = _projection(gm, head)
    if found is None:
        raise _Refuse(f"the logits come from {head.name} ({head.op} "
                      f"{getattr(head.target, '__name__', head.target)}), not a projection")
    hidden, weight, bias = found
    if not isinstance(hidden, fx.Node) or not isinstance(_val(hidden), torch.Tensor):
        raise _Refuse("the projection's input is not a graph value")
    head_shape = _shape(head)
    vocab, size = head_shape[-1], _shape(hidden)[-1]
    weight_shape = tuple(gm.get_parameter(weight).shape) if isinstance(weight, str) else \
        _shape(weight)
    if weight_shape != (vocab, size):
        raise _Refuse(f"the projection's weight is {weight_shape}, not (vocab, hidden)")
    if head in ancestors(targets):
        raise _Refuse("the targets are computed from the logits")
    logits_val = _val(loss.logits)
    if not logits_val.is_floating_point() or not _val(head).is_floating_point():
        raise _Refuse("the logits are not floating point")
    path = [head, *chain, *loss.nodes]
    on_path = set(path)
    uses: list[tuple[fx.Node, fx.Node, bool]] = []
    log_probs = False
    for node, step in zip([head, *chain], [None, *steps]):
        log_probs = log_probs or (step is not None and step[0] == "log_softmax")
        for user in list(node.users):
            if user in on_path or is_assert(user):
                continue
            reads = _size_reads(user, on_path)
            if reads:
                path.extend(reads)
                on_path.update(reads)
            elif log_probs:
                raise _Refuse(f"the log-probabilities are read by {user.name} besides the loss")
            else:
                uses.append((node, user, _output_bound(user)))
    rows = 1
    for s in head_shape[:-1]:
        rows *= s
    return TokenLoss(
        loss=loss.value, head=head, hidden=hidden, weight=weight, bias=bias, targets=targets,
        path=path, chain=chain, steps=steps, transforms=transforms, row_slices=slices,
        ignore_index=loss.ignore_index, label_smoothing=loss.label_smoothing,
        reduction=loss.reduction, tokens=rows, vocab=vocab, hidden_size=size,
        itemsize=logits_val.element_size(), logits_uses=uses)


def find_token_losses(gm: fx.GraphModule) -> Findings:
    """Every cross-entropy over a vocabulary projection in ``gm``, and why others are not."""
    sites: list[TokenLoss] = []
    refused: dict[str, str] = {}
    for node in gm.graph.nodes:
        try:
            loss = _loss_of(gm, node)
            if loss is not None:
                sites.append(_site(gm, loss))
        except _Refuse as why:
            refused[node.name] = str(why)
    heads = [s.head for s in sites]
    for site in list(sites):
        if heads.count(site.head) > 1:
            sites.remove(site)
            refused[site.name] = "another loss reads the same logits"
    return Findings(sites, refused)
