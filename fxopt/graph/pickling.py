"""``torch.save(module)`` of a captured module: refused, with the reason, where it would lose part
of the module.

torch.fx pickles a GraphModule as its generated code and its registered submodules, and re-traces
the code on load. Three things a capture can hold do not survive that:

- a graph per training mode (``fxopt.graph.train_eval``): the re-trace follows one path;
- the bodies of torch.export's higher-order operators, which the graph reads as plain
  attributes, not submodules: they are not pickled;
- the classes of the outputs the graph rebuilds (a Hugging Face ``ModelOutput``, a namedtuple):
  the re-trace runs their constructors on proxies and records a plain dict or tuple.

A module holding any of them raises ``ExportError`` from ``torch.save`` / ``pickle.dumps`` and
says to save its ``state_dict()`` or export a folder instead. Every other capture pickles as
torch.fx pickles it, and keeps what torch.fx's loading drops, as ``torch.load`` keeps it for any
module (``keep_state_when_pickled``): its hooks (a forward hook the user had on the model; the
optimized module's call guard), its ``training`` flag, and the guard's record of what the graphs
run inline (``meta_keys.INLINED``, ``BLOCK_CONSTANTS``). torch.fx rebuilds the module from its
code, and keeps an attribute of the saved one only where the new module lacks it: every
``nn.Module`` has hook dicts, a flag and (a GraphModule) a ``meta``, so the saved ones were lost.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from fxopt.core import meta_keys
from fxopt.core.errors import ExportError
from fxopt.core.modules import HOOK_DICTS, deepcopy_keeping_hooks, set_instance_method
from fxopt.core.torch_private import FULL_BACKWARD_HOOK_FLAG
from fxopt.core.torch_private import set_tracer_class, tracer_class
from fxopt.graph.train_eval import has_eval_graph


class ReloadTracer(fx.Tracer):
    """The tracer torch.load re-traces an fxopt-built GraphModule's code with (its
    ``_tracer_cls``; torch.fx makes every submodule a leaf on top of it). An object the code
    reads as a plain attribute of the module -- a checkpointed region, the input guard, the body
    of a scoped call -- is recorded as that attribute (``get_attr``), which fx's own tracer
    cannot record at all; fxopt's own functions stay calls by the ``torch.fx.wrap`` lines of
    the code (``fxopt.core.modules.wrap_own_calls``). Constructible without arguments, as
    torch.fx constructs it."""

    def create_arg(self, a: Any) -> Any:
        try:
            return super().create_arg(a)
        except NotImplementedError:
            name = next((k for k, v in vars(self.root).items() if v is a), None)
            if name is None:
                raise
            return self.create_node("get_attr", name, (), {})


def reloadable(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` re-traced on load by ``ReloadTracer`` where no tracer made its graph (a block's
    graph, a torch.export capture); a graph a tracer made keeps it (fxopt's symbolic tracer
    records the same attributes)."""
    if tracer_class(gm) is None:
        set_tracer_class(gm, ReloadTracer)
    keep_state_when_pickled(gm)
    return gm


# What torch.fx's loading drops (module docstring); the call guard's record of a root or a block.
_KEPT_ATTRIBUTES = (*HOOK_DICTS, FULL_BACKWARD_HOOK_FLAG, "training")
_KEPT_META = (meta_keys.INLINED, meta_keys.BLOCK_CONSTANTS)


def keep_state_when_pickled(gm: fx.GraphModule) -> None:
    """Pickle ``gm`` as torch.fx does, keeping what its loading would drop (module docstring)."""
    set_instance_method(gm, "__reduce__", _reduce_keeping_state)


def _reduce_keeping_state(self: fx.GraphModule) -> tuple:
    rebuild, args = fx.GraphModule.__reduce__(self)
    state = args[0]
    if isinstance(state, dict) and meta_keys.CHECKED in state.get("meta", {}):
        # the call guard's record of what it last found holds modules; _reloaded resets it
        state = {**state, "meta": {k: v for k, v in state["meta"].items()
                                   if k != meta_keys.CHECKED}}
        args = (state, *args[1:])
    kept = {name: self.__dict__[name] for name in _KEPT_ATTRIBUTES if name in self.__dict__}
    meta = {key: self.meta[key] for key in _KEPT_META if key in self.meta}
    return _reloaded, (rebuild, args, kept, meta)


def _reloaded(rebuild: Any, args: tuple, kept: dict[str, Any], meta: dict[str, Any]
              ) -> fx.GraphModule:
    """The module torch.fx's ``rebuild`` makes, with what ``_reduce_keeping_state`` kept."""
    gm = rebuild(*args)
    gm.__dict__.update(kept)
    gm.meta.update(meta)
    if meta_keys.INLINED in meta:
        gm.meta[meta_keys.CHECKED] = {}  # the guard then checks the loaded tree on its first call
    set_instance_method(gm, "__deepcopy__", deepcopy_keeping_hooks)
    keep_state_when_pickled(gm)
    return gm


def refuse_pickling(gm: fx.GraphModule) -> None:
    """Make pickling ``gm`` raise ``ExportError`` where torch.fx's pickling would lose part of it
    (``unpicklable_because``). ``gm``'s class is its own (torch.fx makes one per instance), so
    no other module changes. Call it again after rebuilding ``gm``'s graph."""
    if unpicklable_because(gm) is not None:
        set_instance_method(gm, "__reduce__", _refuse_reduce)


def unpicklable_because(gm: fx.GraphModule) -> str | None:
    """Why torch.fx's pickling would lose part of ``gm``, or None when it keeps all of it."""
    if has_eval_graph(gm):
        return ("has a graph per training mode, which torch.save cannot keep (torch.fx re-traces "
                "one path of the code when loading)")
    if _reads_unregistered_modules(gm):
        return ("calls the bodies of torch.export's higher-order operators, which torch.save "
                "cannot keep (torch.fx re-traces the generated code when loading, without them)")
    if _builds_classes(gm):
        return ("rebuilds its output's classes in its graph, which torch.save cannot keep "
                "(torch.fx re-traces the generated code when loading and returns plain dicts "
                "and tuples)")
    return None


def _builds_classes(gm: fx.GraphModule) -> bool:
    """Whether ``gm``'s graph calls a class (torch.export captures rebuild a ``ModelOutput`` or a
    namedtuple so)."""
    return any(node.op == "call_function" and isinstance(node.target, type)
               for node in gm.graph.nodes)


def _reads_unregistered_modules(gm: fx.GraphModule) -> bool:
    """Whether a graph of ``gm`` reads a module held as a plain attribute, not a submodule."""
    for module in gm.modules():
        for node in module.graph.find_nodes(op="get_attr") if isinstance(
                module, fx.GraphModule) else ():
            owner_path, _, name = node.target.rpartition(".")
            try:
                owner = module.get_submodule(owner_path)
            except AttributeError:
                continue
            if isinstance(vars(owner).get(name), nn.Module):  # not a registered submodule
                return True
    return False


def _refuse_reduce(self: fx.GraphModule) -> Any:
    raise ExportError(
        f"{type(self).__name__} {unpicklable_because(self)}",
        where="torch.save / pickle",
        hint="save module.state_dict() and load it into a newly optimized model, or write a "
             "folder that loads with torch alone: fxopt.export.export(module, 'out_dir')")
