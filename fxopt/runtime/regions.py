"""Run a piece of a graph under activation checkpointing, without side effects on recompute.

``CheckpointedRegion(body, targets=..., selective=..., recompute=..., ...)`` is what a checkpointed
region of an optimized graph calls: ``inputs = region_inputs(x)``, then
``call_region(self._fxopt_region_0, inputs, self.conv1, self.bn1)``. The call site hands the
region's inputs over in a list (``boxed``): ``x``'s last use in the graph is the hand-over, so the
graph's code drops it there, and the region empties the list. The body is code only: a GraphModule
whose ``forward`` reads ``self.conv1`` & co., run with a ``RootState`` as ``self`` that holds what
the root graph looked up for each of ``targets`` *in this call*. So every parameter, buffer,
submodule and constant a region uses is resolved through the root module when the graph runs, never
held by the region: ``load_state_dict(assign=True)``, ``.to()``, replacing a Parameter, ``deepcopy``
and FSDP2's parameter swap reach the region as they reach the rest of the graph. (A region built
with ``targets=None`` runs ``body`` as a module that holds its own state: torch.utils.checkpoint's
plain behaviour, and how modules saved by fxopt 0.1 load.)

Three graphs, built when the model is optimized (``fxopt.rewrite.region_graphs``):

- ``body``: the region as it was in the model's graph. Run as it is with grad disabled (nothing is
  recomputed) and under ``torch.jit.trace``, through code generated from its graph with the
  boxed calling convention (``forward(self, inputs)`` takes its inputs out of the list and
  empties it), so each input is
  freed at its last use in the body, as in the unoptimized graph: inference pays nothing (an
  exported module's body, code only, carries that code as its ``boxed_forward``). Under
  ``torch.compile`` the body runs as it is.
- ``forward`` (selective regions only): the body that also returns the outputs of the nodes the
  plan keeps (convolutions, matmuls), each run between ``enter_kept`` and ``leave_kept``.
- ``recompute``: what backward runs again: the body without the kept nodes (it reads their kept
  outputs instead), with BatchNorm computing on scratch running statistics
  (``recomputed_batch_norm``) and the counter's increment left out, so BatchNorm's buffers are
  updated exactly once.

In a training forward, ``fxopt.runtime.region_frame`` runs the forward graph under saved-tensor
hooks that save nothing, and the recompute graph when backward first needs a saved tensor: what
``torch.utils.checkpoint(use_reentrant=False)`` does, without a Python callback per ATen op (the
selective policy is the graph itself), an RNG stash for regions that draw no random numbers
(``random``), or buffer copies per call (``shield``: only for a region that writes buffers the
builder cannot recompute without writing, whose recomputation then runs on copies of them as
its forward found them, ``buffers_as_before``). Why not torch's machinery with a policy: its selective checkpointing decides
per ATen op in a ``TorchDispatchMode``, in forward and again in recompute; on small ops that
Python, not the arithmetic, set the time (``benchmarks/recompute_overhead.py``). Why not one
autograd Function per region with a backward graph traced at optimize time: that needs the joint
graph of every region (ATen-level, fixed or symbolic shapes), and gives up the module-level calls
(hooks, FSDP2's per-block parameters) the region runs today; recomputing through the region's own
forward graph keeps autograd's derivatives and the module calls, and costs one forward of the
cheap nodes.

Under ``torch.compile`` the region goes through ``torch.utils.checkpoint`` with the plain body
(the compiled graph updates BatchNorm's buffers once and replays dropout by itself): a selective
region passes SAC's contexts for the heavy ops (``HEAVY_ATEN_OPS``), a full region none. Regions
pickled before the recompute graph existed run through ``torch.utils.checkpoint`` in eager mode
too, as they did (SAC's dispatch mode for a selective one, buffers copied for recompute).

The region object is stored on the GraphModule as a plain attribute, not a submodule, and holds
no tensors: a deep copy or a pickle of it copies code, never weights.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .boxed import boxed_graph
from .region_frame import (  # noqa: F401 -- enter_kept, leave_kept: called by forward graphs
    RegionFrame,
    _autocast_state,
    _devices,
    _RngState,
    enter_kept,
    leave_kept,
)

aten = torch.ops.aten
# ATen ops with a leading underscore: no public promise, so looked up by name (a torch without
# one still imports this module; the op is then not kept). They are named here rather than in
# fxopt.core.torch_private because the runtime cannot import fxopt (export copies it where fxopt
# is not installed); tests/test_torch_private.py checks each exists in the installed torch.
PRIVATE_HEAVY_OPS = ("_scaled_mm", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_fused_attention_overrideable",
                     "_flash_attention_forward", "_efficient_attention_forward",
                     "_grouped_mm", "_scaled_grouped_mm", "_addmm_activation")
# The ops selective recomputation keeps. fxopt's cost model calls a node heavy when one of these
# runs inside it, and the plan names the heavy nodes a selective region keeps (Region.kept); under
# torch.compile SAC keeps these ops' outputs. The GPU forms (grouped and fused-epilogue matmuls,
# the attention kernels' own entry points) are here so that a GPU graph's matmuls count as heavy.
HEAVY_ATEN_OPS = frozenset({
    aten.convolution, aten.mm, aten.addmm, aten.bmm, aten.baddbmm,
    *(getattr(aten, name) for name in PRIVATE_HEAVY_OPS if hasattr(aten, name)),
})


def is_heavy(op: Any) -> bool:
    """Whether the ATen op (an overload such as ``aten.mm.default``) is one of HEAVY_ATEN_OPS."""
    return getattr(op, "overloadpacket", op) in HEAVY_ATEN_OPS


# The underscored ones among the ops a light region recomputes (named here for the reason
# PRIVATE_HEAVY_OPS are; tests/test_torch_private.py checks each exists).
PRIVATE_LIGHT_OPS = ("_unsafe_view", "_to_copy", "_assert_tensor_metadata")
# Ops that copy, concatenate or re-view data (besides those tagged pointwise): with pointwise
# arithmetic, what a light region recomputes (``is_light``).
LIGHT_ATEN_OPS = frozenset(getattr(aten, name) for name in (
    "cat", "stack", "view", "reshape", "expand", "slice", "select", "narrow", "transpose", "t",
    "permute", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "alias",
    "detach", "clone", "flatten", "unflatten", "constant_pad_nd", "repeat", "unfold",
    "as_strided", "lift_fresh_copy", "arange", "full", "ones", "zeros", "scalar_tensor",
    *PRIVATE_LIGHT_OPS) if hasattr(aten, name))


_METADATA_QUERIES = frozenset(getattr(aten, name) for name in (
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous", "dim")
    if hasattr(aten, name))


def is_light(op: Any) -> bool:
    """Whether recomputing the ATen op costs about a pass over its output and needs nothing but
    its inputs: a pointwise op or one of LIGHT_ATEN_OPS that writes nothing in place and draws
    no random numbers."""
    packet = getattr(op, "overloadpacket", op)
    if getattr(op, "namespace", "") == "prim" or packet in _METADATA_QUERIES:
        return True  # a tensor's device, layout or sizes: asked, never computed
    tags = getattr(op, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    schema = getattr(op, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    return packet in LIGHT_ATEN_OPS or torch.Tag.pointwise in tags


# Let saved-tensor hooks (save_on_cpu, fxopt's own saved-tensor analysis) see what SAC keeps,
# where this torch supports choosing it.
_SAC_HOOKS = ({"respect_saved_tensors_hooks": True}
              if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


def _keep_heavy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_heavy(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_all_but_light(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if is_light(op) else CheckpointPolicy.MUST_SAVE


def _autocast_on() -> bool:
    """Under autocast the weight-cast cache makes recompute run casts forward skipped, which
    selective checkpointing rejects; such regions recompute fully instead."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


class RootState:
    """What a region body reads through ``self``, as the call site resolved it for this call.

    ``self.<target>`` in the body's code gives the value passed for ``target``
    (``layers.0.weight`` is reached as ``self.layers`` -> ``"0"`` -> ``weight``).
    """

    def __init__(self, targets: tuple[str, ...], values: tuple[Any, ...]):
        self._slots: list[tuple[Any, str]] = []
        for target, value in zip(targets, values, strict=True):
            owner: Any = self
            *path, name = target.split(".")
            for item in path:
                owner = owner.__dict__.setdefault(item, _Namespace())
            owner.__dict__[name] = value
            self._slots.append((owner, name))

    def slots(self) -> list[tuple[Any, str, Any]]:
        """(owner, attribute name, value) for every value passed."""
        return [(owner, name, owner.__dict__[name]) for owner, name in self._slots]


class _Namespace:
    """One level of a target path inside ``RootState`` (``layers`` of ``layers.0.weight``)."""


def _modules_read(reads: Any) -> list[torch.nn.Module]:
    """Each module ``reads`` reaches, once: the modules a ``RootState`` holds and their
    submodules, or a module holding its own state and its submodules."""
    if isinstance(reads, RootState):
        roots = [value for _, _, value in reads.slots() if isinstance(value, torch.nn.Module)]
    else:
        roots = [reads]
    found: dict[int, torch.nn.Module] = {}
    for root in roots:
        for module in root.modules():
            found.setdefault(id(module), module)
    return list(found.values())


def _held_by_modules(reads: Any) -> list[tuple[dict, str, torch.Tensor]]:
    """(its ``_parameters`` or ``_buffers``, name, tensor) for every tensor the modules
    ``reads`` reaches hold now (``_modules_read``): what a recomputation of them must read again
    (``RegionFrame.held``). Tensors ``reads`` holds directly were resolved in this call
    already."""
    return [(owner, name, t) for module in _modules_read(reads)
            for owner in (vars(module)[container] for container in TENSOR_CONTAINERS)
            for name, t in owner.items() if t is not None]


# nn.Module's dicts of its parameters and of its buffers, which functional_call swaps tensors in
# (named here: the runtime cannot import fxopt.core.torch_private; tests/test_torch_private.py
# checks them)
TENSOR_CONTAINERS = ("_parameters", "_buffers")


def _shieldable(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
            and not value.requires_grad)


def _buffers_read(reads: Any) -> list[tuple[Any, str, torch.Tensor]]:
    """(owner, name, buffer) for every buffer ``reads`` reaches: those of the modules it reaches
    (``_modules_read``), and the buffer tensors a ``RootState`` holds directly."""
    direct = ([(owner, name, value) for owner, name, value in reads.slots() if _shieldable(value)]
              if isinstance(reads, RootState) else [])
    return direct + [(module, name, buffer) for module in _modules_read(reads)
                     for name, buffer in module.named_buffers(recurse=False)
                     if not buffer.requires_grad]


@contextlib.contextmanager
def _buffers_set_to(values: list[tuple[Any, str, torch.Tensor]]) -> Iterator[None]:
    """Inside, each (owner, name) holds a copy of its ``values`` tensor; after, what it held."""
    held = [(owner, name, getattr(owner, name)) for owner, name, _ in values]
    for owner, name, value in values:  # assigning a tensor to a buffer's name replaces it
        setattr(owner, name, value.detach().clone())
    try:
        yield
    finally:
        for owner, name, buffer in held:
            setattr(owner, name, buffer)


def buffers_shielded(reads: Any) -> contextlib.AbstractContextManager:
    """Inside: recomputation writes into copies of the buffers ``reads`` reaches, as they are
    now (``_buffers_read``)."""
    return _buffers_set_to(_buffers_read(reads))


def buffers_as_before(reads: Any) -> Any:
    """Called before a region's forward: a ``shield`` for its recomputation, which then runs on
    copies of the buffers ``reads`` reaches *as the forward found them*. A module that updates a
    buffer in forward and reads it (spectral norm's power iteration: ``_u`` and ``_v``) computes
    its recomputation from the values its forward read, as the model computed once; copies made
    when backward recomputes would hold the forward's update, and recompute another function
    (a weight gradient 0.26% off, float64, on a spectral-normed conv)."""
    values = [(owner, name, buffer.detach().clone()) for owner, name, buffer in _buffers_read(reads)]
    return lambda _reads: _buffers_set_to(values)


@contextlib.contextmanager
def _recomputing(reads: Any, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    with buffers_shielded(reads), inner:  # copies made outside SAC's dispatch mode
        yield


def _eager_contexts(reads: Any, selective: bool
                    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint``'s ``context_fn`` in eager mode: (forward context, recompute context)."""
    if selective and not _autocast_on():
        forward, recompute = create_selective_checkpoint_contexts(_keep_heavy)
    else:
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
    return forward, _recomputing(reads, recompute)


# Under torch.compile: dynamo keeps a ``context_fn`` only if it is a plain function or a
# functools.partial of constants (a bound method loses its ``self``), and AOTAutograd requires it
# to return two TorchDispatchModes. The compiled graph updates BatchNorm's buffers once and
# replays dropout by itself, so only the choice of what to save is left: SAC for a selective
# region (a light one's policy recomputes only light ops), torch's own full recomputation (no
# context_fn) for a full one.
_COMPILED_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _keep_heavy)
_COMPILED_LIGHT = functools.partial(create_selective_checkpoint_contexts, _keep_all_but_light)


class CheckpointedRegion:
    """Callable that runs ``body`` checkpointed, over the state its call site passes.

    ``targets``: the qualified names (on the root module) of what the body reads through
    ``self``, in the order the call site passes their values after the body's inputs; ``None``
    for a body that is a module holding its own state.
    ``recompute``: the recompute graph (``forward(self, *inputs, *kept) -> inner values``); None
    for a region pickled before it existed (it runs through ``torch.utils.checkpoint``).
    ``forward``: a selective region's forward graph (``forward(self, frame, *inputs) ->
    (body's result, kept outputs)``); None for a full region (the body is its forward).
    ``random``: whether the region draws random numbers (its RNG state is stashed for the
    recomputation); ``shield``: whether the recomputation runs on copies of the buffers it reads
    as the forward found them (``buffers_as_before``), for a region writing buffers its recompute
    graph cannot leave alone.
    ``boxed``: the call site passes the body's inputs as one list (``region_inputs``), which the
    region empties; else one by one, as regions pickled before it existed are called.
    ``light``: a selective region that recomputes only its light ops (``is_light``) and keeps
    every other output they read; under torch.compile its policy says so.
    """

    targets: tuple[str, ...] | None = None  # regions pickled before targets existed hold state
    boxed: bool = False  # regions pickled before call sites handed inputs over take them as is
    forward: torch.nn.Module | None = None
    recompute: torch.nn.Module | None = None  # regions pickled before it existed: torch's checkpoint
    random: bool = True
    shield: bool = True
    light: bool = False

    def __init__(self, body: torch.nn.Module, *, selective: bool,
                 targets: tuple[str, ...] | None = None, forward: torch.nn.Module | None = None,
                 recompute: torch.nn.Module | None = None, random: bool = True,
                 shield: bool = True, boxed: bool = False, light: bool = False):
        self.body = body
        self.light = light
        self.boxed = boxed
        self.selective = selective
        self.targets = None if targets is None else tuple(targets)
        self.forward = forward
        self.recompute = recompute
        self.random = random
        self.shield = shield

    def run(self, reads: Any, *inputs: Any) -> Any:
        """The body's forward on ``inputs``, reading ``reads`` (a RootState) as ``self``."""
        if self.targets is None:
            return self.body(*inputs)
        return type(self.body).forward(reads, *inputs)

    def run_boxed(self, reads: Any, box: list) -> Any:
        """The body's forward on the inputs in ``box``, which it empties, so that with grad
        disabled each input is freed at its last use in the body (a code-only body without a
        ``boxed_forward`` holds them until it returns)."""
        forward = _boxed_forward(self.body)
        if forward is not None:
            return forward(reads, box)
        return self.run(reads, *_taken(box))

    def __call__(self, *args: Any) -> Any:
        if self.boxed:  # the checkpoint pass gives every boxed region its targets
            box, reads = args[0], RootState(self.targets, args[1:])
            if _plain_call() and not torch.compiler.is_compiling():
                return self.run_boxed(reads, box)
            inputs = _taken(box)
        elif self.targets is None:
            inputs, reads = args, self.body
        else:
            split = len(args) - len(self.targets)
            inputs, reads = args[:split], RootState(self.targets, args[split:])
        if _plain_call():
            return self.run(reads, *inputs)
        if self.recompute is None or torch.compiler.is_compiling():
            return self._torch_checkpoint(reads, inputs)
        return self._checkpointed(reads, inputs)

    def _checkpointed(self, reads: Any, inputs: tuple) -> Any:
        """A training forward: the forward graph under saved-tensor hooks that save nothing
        (``fxopt.runtime.region_frame``)."""
        frame = RegionFrame(functools.partial(_graph_forward, self.recompute), reads,
                            buffers_as_before(reads) if self.shield else None,
                            self.forward is not None)
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)
        if self.random:
            state = reads.slots() if isinstance(reads, RootState) else ()
            frame.rng = _RngState(_devices([*inputs, *(value for _, _, value in state)]))
        frame.autocast = _autocast_state(device.type if device is not None else "cpu")
        with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
            if self.forward is None:
                result, kept = self.run(reads, *inputs), ()
            else:
                result, kept = type(self.forward).forward(reads, frame, *inputs)
        frame.save(inputs, kept)
        frame.held = _held_by_modules(reads)
        return result

    def _torch_checkpoint(self, reads: Any, inputs: tuple) -> Any:
        """``torch.utils.checkpoint`` over the body: under torch.compile, and for regions pickled
        before the recompute graph existed."""
        function = functools.partial(self.run, reads)
        if torch.compiler.is_compiling():
            selective = self.selective and not _autocast_on()
            policy = _COMPILED_LIGHT if self.light else _COMPILED_SELECTIVE
            contexts = {"context_fn": policy} if selective else {}
        else:
            contexts = {"context_fn": functools.partial(_eager_contexts, reads, self.selective)}
        return checkpoint(function, *inputs, use_reentrant=False, preserve_rng_state=True,
                          **contexts, **_SAC_HOOKS)

    def __repr__(self) -> str:
        kind = "light" if self.light else "selective" if self.selective else "full"
        graph = getattr(self.body, "graph", None)  # an exported body is plain generated code
        size = f", {len(graph.nodes)} nodes" if graph is not None else ""
        return f"CheckpointedRegion({kind}{size})"


def _plain_call() -> bool:
    """Whether a region runs as its plain body: without grad (nothing to recompute), or under
    ``torch.jit.trace``, which records the operations a call runs (a TorchScript graph has no
    checkpointing; the saved-tensor hooks' bookkeeping made two traces of one call differ, so
    the trace's own check failed)."""
    return not torch.is_grad_enabled() or torch.jit.is_tracing()


def _graph_forward(graph_module: torch.nn.Module, reads: Any, *args: Any) -> Any:
    return type(graph_module).forward(reads, *args)


def call_region(region: CheckpointedRegion, *args: Any) -> Any:
    """The graph's call site of a region: ``call_region(self._fxopt_region_0, inputs,
    self.conv1)`` (``inputs = region_inputs(x)``; a region pickled before that: ``x`` itself)."""
    return region(*args)


def region_inputs(*values: Any) -> list:
    """A boxed region's inputs, handed over in a list the region empties: the graph's code drops
    each value after its last use, which is this call, so no local of the graph holds it while the
    region runs."""
    return list(values)


def _taken(box: list) -> tuple:
    """The inputs in ``box``, which is left empty."""
    inputs = tuple(box)
    box.clear()
    return inputs


# body -> (the body's code when generated, its boxed forward): generated once per body, dropped
# with it; a body whose graph was edited and recompiled since gets new code.
_BOXED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _boxed_forward(body: torch.nn.Module) -> Callable[[Any, list], Any] | None:
    """``body``'s forward as a boxed function of (self, inputs list): an exported body's own
    ``boxed_forward`` (``fxopt.export`` writes it), else code generated from its graph; None for
    a body with neither."""
    written = getattr(type(body), "boxed_forward", None)
    if written is not None:
        return written
    graph = getattr(body, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return None
    code = body.code
    cached = _BOXED.get(body)
    if cached is not None and cached[0] is code:
        return cached[1]
    boxed = boxed_graph(graph)
    # Code for a graph that calls functions registered with ``torch.fx.wrap`` begins by
    # registering them again, for a later symbolic trace of the code (never, for this one), and
    # torch.fx.wrap holds its own frame and so every frame below it: run here, in the middle of
    # a forward, that reference cycle kept the forward's tensors alive until the next garbage
    # collection. The body's own code has registered them already.
    for node in boxed.nodes:
        node.meta.pop("is_wrapped", None)
    generated = boxed.python_code("self")
    namespace = dict(generated.globals)
    exec(compile(generated.src, f"<fxopt boxed region body {type(body).__name__}>", "exec"),
         namespace)
    _BOXED[body] = (code, namespace["forward"])
    return namespace["forward"]


# The batch-norm classes whose training-mode forward is ``F.batch_norm`` over their buffers and a
# counter increment, nothing else (a subclass may do more: it is called as it is).
_PLAIN_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def recomputed_batch_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` as a recompute graph runs it: in training mode, batch statistics over
    scratch running statistics (updated and thrown away; the output depends on the batch alone)
    and no counter increment, so the module's buffers are written once, by the forward; in eval
    mode (or without running statistics), the call itself, which writes nothing."""
    if (type(module) in _PLAIN_BATCH_NORMS and module.training
            and module.running_mean is not None and module.running_var is not None):
        # torch.batch_norm as F.batch_norm calls it (its checks passed in the forward)
        return torch.batch_norm(
            x, module.weight, module.bias, torch.empty_like(module.running_mean),
            torch.empty_like(module.running_var), True, 0.0, module.eps,
            torch.backends.cudnn.enabled)
    return module(x)
