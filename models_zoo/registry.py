"""The name -> ZooEntry table and its lookup functions."""

from __future__ import annotations

import difflib

from torch import nn

from fxopt.core.errors import InputError
from fxopt.models_zoo import recurrent, small_nets, torchvision_models, transformer, unet
from fxopt.models_zoo.entry import ZooEntry

_ENTRIES: dict[str, ZooEntry] = {
    entry.name: entry
    for module in (small_nets, unet, transformer, recurrent, torchvision_models)
    for entry in module.ENTRIES
}


def names() -> list[str]:
    """All zoo model names, sorted."""
    return sorted(_ENTRIES)


def selected(names_csv: str | None, *, include_large: bool = False) -> list[str]:
    """The models a benchmark's ``--models a,b`` names, or every model but those tagged
    ``large`` (unless ``include_large``)."""
    if names_csv:
        return names_csv.split(",")
    return [n for n in names() if include_large or "large" not in get(n).tags]


def get(name: str) -> ZooEntry:
    """The entry called ``name``; an unknown name raises InputError with the known names."""
    try:
        return _ENTRIES[name]
    except KeyError:
        close = difflib.get_close_matches(name, names(), n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else ""
        raise InputError(f"unknown zoo model {name!r}{suggestion}",
                         where="models_zoo",
                         hint=f"use one of: {', '.join(names())}") from None


def build(name: str, batch_size: int | None = None) -> tuple[nn.Module, tuple]:
    """A fresh model and its example inputs (at ``batch_size``, default the entry's own)."""
    entry = get(name)
    batch = entry.default_batch if batch_size is None else batch_size
    return entry.build(), entry.example_inputs(batch)
