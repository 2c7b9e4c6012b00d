"""The call guard of a module ``fxopt.export`` wrote: what a script does to one of its submodules
takes effect as on the user's model, or the call is refused before any compute.

The generated ``forward`` of the root and of each block reads the parameters and buffers of the
modules it does not call (torch.fx traced through their ``forward``; the export writes them as
plain ``torch.nn.Module`` namespaces) and runs their operations itself, in the mode of the code
that runs them. So on such a module:

- a hook (forward, forward pre-, backward) would never run; on a module a checkpointed region
  calls again in backward it would run twice a step with grad enabled;
- a module put in its place would not run: the code reads tensors off it by name;
- another mode than that of the code running it (the root's, or a block's, which runs its
  eval-mode code when its own flag is off) would not be read, where the mode matters: a
  BatchNorm, a Dropout, a module whose ``forward`` reads ``self.training`` (the record says
  which, from what ``fxopt.optimize`` saw).

``InlineGuard(root, inlined, recomputed)`` is the forward pre-hook the exported ``__init__``
registers on the root, holding that record. Each call walks the module tree for a signature
(each module's class, mode and whether it has hooks) and reads the record only when the
signature is not the one last found consistent in that mode, with grad on or off.

Imports torch and its siblings only: ``fxopt.export`` copies it next to the generated code.
Not handled: what the user's classes held (the exported namespaces hold tensors and submodules
only, so a constant set on one is read by nothing, as on any plain module), and process-wide
module hooks.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError
from .module_hooks import call_hooks, has_hooks


class InlineGuard:
    """Refuses, before any compute, a change to a submodule the exported code runs inline."""

    def __init__(self, root: torch.nn.Module, inlined: dict[str, str | None],
                 recomputed: tuple[str, ...] = ()):
        """``inlined``: the path of each module the code runs inline -> where its mode matters,
        the path of the module whose code runs it (``""``: the root; else a block), else None.
        ``recomputed``: the modules a checkpointed region calls again in backward."""
        self.inlined = dict(inlined)
        self.recomputed = tuple(recomputed)
        self.classes = {path: _class_name(type(root.get_submodule(path))) for path in inlined}
        self.consistent: dict[tuple[bool, bool], tuple] = {}

    def __call__(self, root: torch.nn.Module, args: Any) -> None:
        key = (root.training, torch.is_grad_enabled())
        signature = _signature(root)
        if self.consistent.get(key) == signature:
            return
        self._refuse(root)
        if not torch.compiler.is_compiling():
            self.consistent[key] = signature

    def _refuse(self, root: torch.nn.Module) -> None:
        for path, runner in self.inlined.items():
            module = _submodule(root, path)
            written = self.classes[path].rpartition(".")[2]
            if module is None or _class_name(type(module)) != self.classes[path]:
                raise ConfigError(
                    f"{path} is {'gone' if module is None else f'a {type(module).__name__}'} "
                    f"now, where fxopt.export wrote a {written}: the exported code runs that "
                    "module's operations itself, reading its tensors by name, so it would not "
                    "run what replaced it",
                    where=f"{path} ({written})",
                    hint="make the change on your model, optimize and export it again; in the "
                         "exported module, replace only the blocks its forward calls")
            kinds = call_hooks(module)
            if kinds:
                raise ConfigError(
                    f"{path} has {' and '.join(kinds)}, but the exported code never calls it: "
                    "it runs that module's operations itself, so the hooks would never run",
                    where=f"{path} ({type(module).__name__})",
                    hint="register hooks on the exported module itself or on a block its "
                         "forward calls, or use the module fxopt.optimize returns, which keeps "
                         "modules with hooks as calls when they are registered before optimize")
            if runner is None:
                continue
            runs_in = (root if not runner else root.get_submodule(runner)).training
            if module.training != runs_in:
                own, code = ("train" if module.training else "eval"), ("train" if runs_in
                                                                       else "eval")
                whose = "the module" if not runner else f"{runner}, a block the code calls,"
                raise ConfigError(
                    f"{path} is in {own} mode while {whose} is in {code} mode: the exported "
                    f"code runs it inline, in {code} mode, and its mode changes what it computes",
                    where=f"{path} ({type(module).__name__})",
                    hint="switch modes on the whole module (module.train() / module.eval()) or "
                         "on a block its forward calls")
        if not torch.is_grad_enabled():
            return
        for path in self.recomputed:
            module = _submodule(root, path)
            if module is not None and has_hooks(module):
                raise ConfigError(
                    f"{path} has {' and '.join(call_hooks(module))}, and the exported code "
                    "recomputes it in backward (a checkpointed region runs it again): with grad "
                    "enabled the hooks would run twice a step",
                    where=f"{path} ({type(module).__name__})",
                    hint="run the module under torch.no_grad() with those hooks, where nothing "
                         "is recomputed, or remove them (handle.remove())")


def _signature(root: torch.nn.Module) -> tuple:
    """Each module's class, mode and whether it has hooks, in the order of ``modules()``."""
    signature: list = []
    for module in root.modules():
        signature += (id(type(module)), module.training, has_hooks(module))
    return tuple(signature)


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
