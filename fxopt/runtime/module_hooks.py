"""Which hooks a module has that run when it is called.

In the runtime, the lowest layer, so that the exported module's call guard
(``fxopt.runtime.inline_guard``, copied next to the generated code) asks it as fxopt does;
``fxopt.core.modules`` re-exports it. Imports nothing.
"""

from __future__ import annotations

from typing import Any

# The hook dicts whose hooks run when the module is called or when gradients flow back through
# that call, with what to call them in a message. ``*_with_kwargs`` and ``*_always_called`` only
# mark entries of the dict before them; they are listed so a hook is found whichever dict a
# future torch keeps it in.
CALL_HOOK_DICTS: dict[str, str] = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_pre_hooks_with_kwargs": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_forward_hooks_with_kwargs": "forward hooks",
    "_forward_hooks_always_called": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
}


def call_hooks(module: Any) -> list[str]:
    """The kinds of hooks ``module`` itself has that run when it is called, e.g. ["forward hooks"].

    Counted: forward pre-hooks and forward hooks (also those registered ``with_kwargs=True`` or
    ``always_call=True``), backward pre-hooks (``register_full_backward_pre_hook``) and backward
    hooks (``register_full_backward_hook`` and the legacy ``register_backward_hook``). Not
    counted: state_dict and load_state_dict hooks, which never see a call; hooks of the module's
    submodules (ask each); and the process-wide hooks of ``torch.nn.modules.module``
    (``register_module_forward_hook`` & co.), which belong to no module: they fire on every
    module call, and fxopt keeps no promise about which module calls exist after tracing (torch.fx
    already inlines every module it traces through), so they neither stop a pass nor are
    reported.
    """
    kinds: list[str] = []
    for name, kind in CALL_HOOK_DICTS.items():
        # A module unpickled from an old torch may lack the newer dicts.
        if getattr(module, name, None) and kind not in kinds:
            kinds.append(kind)
    return kinds


def has_hooks(module: Any) -> bool:
    """Whether ``module`` has hooks that run when it is called; see ``call_hooks``.

    A pass must then keep every call of the module as a call of that module, with the same
    inputs and outputs: replacing the call (by a functional form), skipping it, or overwriting its
    inputs or outputs in place would stop the hooks firing, change what they see, or (full
    backward hooks) make autograd raise.
    """
    state = module.__dict__  # plain lookups: the call guards ask this of every submodule on
    for name in CALL_HOOK_DICTS:  # every call
        if state.get(name):
            return True
    return False
