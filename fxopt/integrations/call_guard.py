"""The optimized module's run-time guard: what a script does to a submodule after
``fxopt.optimize`` must take effect as it would on the user's model, or fxopt refuses the call.

The optimized graph calls the root, its kept blocks and some leaf modules as modules; every other
module has its operations run inline (torch.fx traced through it, torch.export lowered it, a pass
replaced the call by a functional form), in the mode of the root, and a checkpointed region runs
the modules it recomputes a second time in backward. So what a script changes on a module the
graph runs inline does not reach the computation:

- a module sharded with FSDP2's ``fully_shard`` that the graph never calls: its parameters are
  never gathered (``fxopt.integrations.fsdp``);
- forward pre-hooks, forward hooks and backward hooks on a module the graph never calls would
  never run: a feature-extraction hook (``model.layer4.register_forward_hook``),
  ``torch.nn.utils.prune``'s or ``spectral_norm``'s pre-hook, a quantization observer; on a module
  a region recomputes they would run twice a step with grad enabled (for a BatchNorm, whose
  recomputation computes batch statistics without calling it, not at all the second time, so an
  output they change would be rebuilt unchanged);
- a module replaced (``model.layers[0].mlp = ...``, a LoRA wrapper put in after ``optimize``):
  the graph keeps computing what the old one computed, reading the new one's parameters by name
  where it has them;
- a constant of a ``torch.nn`` module set anew (a Dropout's ``p``, a norm's ``eps`` or
  ``momentum``, ``fxopt.core.modules.settable_constants``): the graph has the old value built in;
  likewise a scalar attribute (a flag, a scale, a size, a list of sizes) of a module of another
  class set anew, deleted or, a list, changed in place
  (``fxopt.core.modules.constant_values``): its ``forward`` may have read it,
  and the graph has what it read built in; the user's root's are the optimized module's own
  (``fxopt.core.modules.carry_constants``), and guarded alike;
- a module switched to another mode than the graph that runs it (the root's, or a kept block's,
  which runs its own eval-mode graph when its flag is off) where its mode matters: a BatchNorm
  with running statistics or a Dropout (p > 0) (a frozen BatchNorm, Monte Carlo dropout), or a
  module the capture found to compute differently in the two modes (its forward, or a
  submodule's, reads ``self.training``: ``fxopt.graph.train_eval.modules_the_mode_changes``):
  the graph runs it in its own mode;
- on a Hugging Face model, a field of ``config`` set anew where a forward reads it
  (``output_hidden_states``, a sequence classifier's ``pad_token_id``): the graph has the
  config it was captured under built in (``fxopt.integrations.hf_trainer.refuse_changed_config``).

``refuse_what_would_not_run`` is the one forward pre-hook ``fxopt.optimize`` registers on the
module it returns (``guard_calls``, which also records the class name and constants of each
module run inline, ``meta_keys.INLINED``). It raises ``ConfigError`` naming the module before
any compute. Hooks registered on the model before ``optimize`` are planned for instead: symbolic
tracing keeps a hooked module as a call, passes leave it alone and the checkpoint plan keeps it
out of its regions, so they run once a step as on the user's model. A call compares the modules
the check depends on (those the graphs run inline or recompute, and the modules above them)
with what it last found consistent in that mode and grad mode (``meta_keys.CHECKED``): where,
of which class, in which mode, with hooks or not, with which constants; only when one changed
(after FSDP2 swaps classes, say) does it read the graphs and the record. On a CNN whose graph
calls every module that is a comparison of nothing. The hook itself holds nothing, and a deep
copy or a loaded checkpoint starts with no such record, so each is judged as it is.

The module ``fxopt.export`` writes has a guard of its own, torch-only
(``fxopt.runtime.inline_guard``): hooks, replaced modules and modes, from the same record.

Not handled: an attribute of a module of the user's own class that is neither a scalar nor a
tuple or list of them (a dict, an object) changed in place where the graph runs it inline (the
graph keeps what its forward read when captured); a ``training`` flag set on one module alone
(not by ``.train()``/``.eval()``, which switch its submodules too) where only its submodules'
operations show the mode; such an attribute of the user's root module (the optimized module
does not hold it); process-wide module hooks
(``register_module_forward_hook``), which belong to no module; a hook added while the forward
runs; a scalar attribute of the user's root refused though its forward never read it (a
counter a script keeps on the model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from fxopt.core import meta_keys
from fxopt.core.errors import ConfigError
from fxopt.core.modules import (
    UNSET,
    call_hooks,
    constant_values,
    has_hooks,
    modules_as_they_are,
    reads_its_own_mode,
    settable_constants,
    still_as_they_were,
)
from fxopt.core.torch_private import BatchNormBase, forward_pre_hooks
from fxopt.graph.graphs import (
    called_paths,
    graph_running,
    inlined_paths,
    recomputed_paths,
    recomputed_with_what_they_call,
)
from fxopt.integrations.fsdp import fsdp_module_class, refuse_uncalled_shards
from fxopt.integrations.hf_trainer import PretrainedInterface, refuse_changed_config


def guard_calls(gm: fx.GraphModule) -> None:
    """Register ``refuse_what_would_not_run`` on ``gm`` (once: a module optimized again keeps
    one), and record the classes of the modules its graphs run inline."""
    if refuse_what_would_not_run not in forward_pre_hooks(gm):
        gm.register_forward_pre_hook(refuse_what_would_not_run)
    trace = gm.meta.get(meta_keys.TRACE)
    moded = frozenset(getattr(trace, "mode_dependent_modules", ()))
    gm.meta[meta_keys.INLINED] = tuple(
        (path, _class_name(type(sub)), constant_values(sub), path in moded)
        for path, sub in ((p, gm.get_submodule(p)) for p in inlined_paths(gm)))
    gm.meta[meta_keys.CHECKED] = {}  # there from the start: under torch.compile a key added
    #                                   on the first call would recompile the guard


def refuse_what_would_not_run(module: nn.Module, args: Any) -> None:
    """``ConfigError`` for a shard, hooks, a replaced module, a module in another mode under
    ``module`` or a config field set anew that would not take effect as on the user's model
    (module docstring).

    The whole check runs when what it depends on may have changed: a record of the modules it
    watches (``_watched``: those the graphs run inline or recompute, and the modules above
    them), found consistent for the module's mode and grad mode, is kept in
    ``meta_keys.CHECKED``, and a call where none of them changed (``still_as_they_were``)
    costs a look at each, no more."""
    if isinstance(module, PretrainedInterface):
        refuse_changed_config(module)
    meta = getattr(module, "meta", None)
    if not (isinstance(meta, dict) and meta_keys.INLINED in meta):  # guarded by an old fxopt
        refuse_uncalled_shards(module)
        _refuse_hooks(module)
        return
    checked = meta.setdefault(meta_keys.CHECKED, {})
    key = (module.training, torch.is_grad_enabled())
    seen = checked.get(key)
    if seen is not None and seen[0] is module and still_as_they_were(seen[1]):
        own = module.__dict__  # the user's root's constants, which the module holds itself
        for name, value in meta.get(meta_keys.BLOCK_CONSTANTS, {}).items():
            if own.get(name, UNSET) != value:
                break
        else:
            return
    refuse_uncalled_shards(module)
    _refuse_hooks(module)
    _refuse_changed_modules(module, meta[meta_keys.INLINED])
    if not torch.compiler.is_compiling():
        checked[key] = (module, _watched(module, meta[meta_keys.INLINED]))


def _watched(root: nn.Module, inlined: tuple) -> tuple[tuple, ...]:
    """What the check depends on, as it is now (``modules_as_they_are``): each module the
    graphs run inline, each module a region recomputes (and what a recomputed leaf calls), each
    kept block with constants, and every module above those. Every other module is one the
    graphs call, whose hooks, mode and constants take effect as on the user's model, wherever
    it is swapped for another."""
    paths = {path for path, *_ in inlined} | recomputed_with_what_they_call(root)
    paths.update(p for p, m in root.named_modules()
                 if isinstance(m, fx.GraphModule) and m.meta.get(meta_keys.BLOCK_CONSTANTS))
    return modules_as_they_are(root, paths)


def _refuse_hooks(root: nn.Module) -> None:
    paths: dict[int, list[str]] = {}
    for path, sub in root.named_modules(remove_duplicate=False):
        if path and has_hooks(sub):
            paths.setdefault(id(sub), []).append(path)
    if not paths:
        return
    called = called_paths(root)
    recomputed = recomputed_paths(root) if torch.is_grad_enabled() else frozenset()
    sharded = fsdp_module_class()
    for where in paths.values():
        sub = root.get_submodule(where[0])
        kinds = " and ".join(call_hooks(sub))
        name = f"{where[0]} ({type(sub).__name__})"
        # under a leaf the graph calls, whose own forward calls it (and runs its hooks)
        in_leaf = [p for p in where if p not in called and graph_running(root, p, called) is None]
        if not called.intersection(where) and not in_leaf:
            raise ConfigError(
                f"{where[0]} has {kinds}, but the optimized module never calls it: its graph "
                "runs that module's operations inline, so the hooks would never run",
                where=name,
                hint="register the hooks on your model before fxopt.optimize: fxopt then keeps "
                     "the module as a call (symbolic tracing; torch.export refuses models with "
                     "hooks), and they run as on your model; or remove them (handle.remove())")
        again = recomputed.intersection(where) or any(
            ".".join(p.split(".")[:end]) in recomputed for p in in_leaf
            for end in range(1, p.count(".") + 1))
        if again and not (sharded is not None and isinstance(sub, sharded)):
            raise ConfigError(
                f"{where[0]} has {kinds}, and the optimized module recomputes it in backward "
                "(a checkpointed region runs it again): with grad enabled the hooks would run "
                "twice a step"
                + (", and not at all in the recomputation of a BatchNorm, which computes its "
                   "statistics without calling it" if isinstance(sub, BatchNormBase) else ""),
                where=name,
                hint="register the hooks on your model before fxopt.optimize: the plan then "
                     "leaves modules with hooks out of its regions; or run the model under "
                     "torch.no_grad(), where nothing is recomputed")


def _refuse_changed_modules(root: nn.Module,
                            inlined: tuple[tuple[str, str, tuple, bool], ...]) -> None:
    """``ConfigError`` when a module the graphs run inline was replaced or removed, has another
    value of a constant (``constant_values``), or is in another mode than the graph that runs
    it while its mode matters (a BatchNorm, a Dropout, or a module whose operations the
    capture found to differ between the modes); or when a kept block's constants
    (``meta_keys.BLOCK_CONSTANTS``) changed."""
    for path, kind, constants, _ in inlined:
        try:
            current = root.get_submodule(path)
        except AttributeError:
            current = None
        if current is None or not _same_class(current, kind):
            seen = kind.rpartition(".")[2]
            raise ConfigError(
                f"{path} is {'gone' if current is None else f'a {type(current).__name__}'} "
                f"now, where fxopt.optimize saw a {seen}: the optimized graph runs that "
                f"module's operations inline, as the {seen} ran them, so it would not run what "
                "replaced it",
                where=f"{path} ({seen})",
                hint="make the change on your model, then optimize it (wrappers such as LoRA "
                     "adapters go in before fxopt.optimize); after optimize, replace only "
                     "modules the graph calls: the blocks fxopt.blocks(module) lists")
        now = dict(constant_values(current))
        if any(now.get(name, UNSET) != value for name, value in constants):
            _refuse_changed_constant(path, current, dict(constants), now)
    called = None
    for path, _, _, mode_matters in inlined:
        current = root.get_submodule(path)
        if not (mode_matters or reads_its_own_mode(current)):
            continue
        called = called_paths(root) if called is None else called
        runner = graph_running(root, path, called)
        runs_in = None if runner is None else root.get_submodule(runner).training
        if runs_in is not None and current.training != runs_in:
            _refuse_other_mode(path, current, runner, runs_in,
                               torch_reader=reads_its_own_mode(current))
    for path, block in root.named_modules():
        recorded = (block.meta.get(meta_keys.BLOCK_CONSTANTS)
                    if isinstance(block, fx.GraphModule) else None)
        if recorded:
            now = dict(constant_values(block))
            if now != recorded:
                _refuse_changed_constant(path, block, recorded, now)


def _refuse_other_mode(path: str, module: nn.Module, runner: str, runs_in: bool,
                       *, torch_reader: bool) -> None:
    cls = type(module).__name__
    own, graph = ("train" if module.training else "eval"), ("train" if runs_in else "eval")
    whose = (f"the module is in {graph} mode: the optimized graph runs it inline, in the "
             "module's mode" if not runner else
             f"{runner}, a block the optimized graph calls, is in {graph} mode: the block's "
             "graph runs it inline, in the block's mode")
    why = ("so its own flag would not be read" if torch_reader else
           "and what it computes depends on the mode: fxopt.optimize traced it in both and its "
           "operations differ (its forward, or a module's under it, reads self.training)")
    raise ConfigError(
        f"{path} ({cls}) is in {own} mode while {whose}, {why}",
        where=f"{path} ({cls})",
        hint="switch modes on the whole module (module.train() / module.eval()) or on a block "
             f"fxopt.blocks(module) lists; to run {path} in a mode of its own, optimize with "
             f"it kept as a call, leaf_modules=({path!r},)"
             + ("; to train with BatchNorm frozen or dropout on in eval, optimize with "
                "capture='fx' (symbolic tracing calls BatchNorm and Dropout modules, which read "
                "their own flag)" if torch_reader else ""))


def _refuse_changed_constant(path: str, module: nn.Module, was: dict[str, object],
                             now: dict[str, object]) -> None:
    """``ConfigError`` naming the first constant of ``module`` set anew or deleted. One added
    since optimize is not: the forward captured did not read it (but through a default)."""
    name = next(n for n in was if now.get(n, UNSET) != was[n])

    def said(values: dict[str, object]) -> str:
        return repr(values.get(name, UNSET))

    cls = type(module).__name__
    if not path:  # the optimized module's own, carried from the user's root
        built_in = (f"runs your model's forward as fxopt.optimize captured it: had it read "
                    f"{name}, the value it read then is built in")
    elif settable_constants(type(module)):
        built_in = f"runs that {cls} inline with {name}={said(was)} built in"
    else:
        built_in = (f"runs that {cls} as fxopt.optimize captured it: had its forward read "
                    f"{name}, the value it read then is built in")
    hint = f"set {name} on your model, then optimize it; or set it back to {said(was)}"
    if isinstance(module, BatchNormBase) and name == "momentum":
        hint += ("; to recompute BatchNorm statistics in a pass over data, as "
                 "torch.optim.swa_utils.update_bn does (momentum None), run it on your model, "
                 "or optimize with capture='fx', whose graph calls BatchNorm as a module")
    raise ConfigError(
        f"{f'{path}.' if path else ''}{name} is {said(now)} now, where fxopt.optimize saw "
        f"{said(was)}: the optimized graph {built_in}",
        where=f"{path} ({cls})" if path else name, hint=hint)


def _class_name(cls: type) -> str:
    """What the record keeps of a class: its module and qualified name, which pickle (a class
    torch.fx made for one GraphModule does not) and are the same for every GraphModule."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _same_class(module: nn.Module, kind: str) -> bool:
    """``module`` is still of the class named ``kind``, or of the class FSDP2's ``fully_shard``
    made of it (``FSDP<class>``, deriving from FSDPModule and that class)."""
    if _class_name(type(module)) == kind:
        return True
    sharded = fsdp_module_class()
    return (sharded is not None and isinstance(module, sharded)
            and any(_class_name(base) == kind for base in type(module).__bases__))
