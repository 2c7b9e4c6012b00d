"""A GraphModule that stands for an ``nn.Sequential`` indexes like one.

Scripts reach into a Sequential by position: ``model[0]``, ``model.body[1][0].requires_grad_()``,
``len(model.features)``, ``for layer in model.encoder``. The optimized module of a Sequential
model, and a block ``fxopt.rewrite.blocks`` keeps for a Sequential, are GraphModules, which
have none of that: a script raised ``TypeError: 'Sequential' object is not subscriptable``.
``keep_sequential_interface`` gives such a module ``SequentialInterface``: ``[i]``, slices,
``len``, iteration and ``in`` over its own submodules, in order, as the Sequential answered
them (fxopt's copies of the user's modules, holding the user's parameters; a slice is a new
``nn.Sequential`` of them, as Sequential's own slices are).

Read-only: assigning or deleting by index (``model[0] = ...``) is not offered (a module the
graph runs cannot be replaced that way; ``fxopt.integrations.call_guard`` refuses a replaced
one). Copies made with ``copy.copy`` or by pickling (``torch.save``) are plain GraphModules,
as for ``fxopt.integrations.hf_trainer``'s interface; ``copy.deepcopy`` and fxopt's own copies
keep it (torch.fx derives a copy's class from the first class that is no per-instance one).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import fx, nn

from fxopt.core.torch_private import derive_instance_class


class SequentialInterface(fx.GraphModule):
    """Base of the class of a GraphModule standing for an ``nn.Sequential``."""

    def __getitem__(self, index: int | slice) -> nn.Module:
        children = list(self._modules.values())
        if isinstance(index, slice):
            return nn.Sequential(*children[index])
        return children[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __contains__(self, module: object) -> bool:
        return any(module is child for child in self._modules.values())


def keep_sequential_interface(gm: fx.GraphModule, module: nn.Module) -> None:
    """Give ``gm``, which stands for ``module``, ``SequentialInterface`` when ``module`` is an
    ``nn.Sequential`` (or stands for one); any other module is left alone. ``gm``'s class
    becomes a subclass of it and of its own per-instance class, which keeps its name; its
    forward and whatever was set on its class stay."""
    if isinstance(gm, SequentialInterface) or not isinstance(
            module, (nn.Sequential, SequentialInterface)):
        return
    derive_instance_class(gm, SequentialInterface)
