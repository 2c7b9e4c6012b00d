"""The one way fxopt walks a model's inputs and outputs: ``named_leaves``, ``map_tensors``,
``sketch``.

Models return more than pytree knows: Hugging Face's ``ModelOutput`` and diffusers' ``BaseOutput``
are ``OrderedDict`` subclasses *and* dataclasses (pytree sees an unregistered subclass as one
opaque leaf, so its tensors were neither compared nor differentiated), user dataclasses and dict
subclasses, and pytree nodes registered without a key function (diffusers registers its output
classes so, and ``tree_flatten_with_path`` raises ``ValueError`` on them). This walk knows:

- tensors and everything else that is not a container: leaves;
- dataclass instances (``ModelOutput`` included): their fields, named ``.field``;
- mappings (``dict``, ``OrderedDict`` and any subclass): their items, named ``['key']``;
- namedtuples: their fields, named ``.field``;
- tuples and lists: their items, named ``[i]``.

Names follow ``torch.utils._pytree.keystr``, so ``output[0]['logits']`` reads as it did.
Not handled: containers of other kinds (sets, custom classes holding tensors in attributes)
are leaves, compared as values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def _children(value: Any) -> list[tuple[str, Any]] | None:
    """``value``'s (name suffix, child) pairs, or None for a leaf."""
    if isinstance(value, torch.Tensor):
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, Mapping):
        return [(f"[{key!r}]", value[key]) for key in value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return [(f".{name}", item) for name, item in zip(value._fields, value)]
    if isinstance(value, (tuple, list)):
        return [(f"[{index}]", item) for index, item in enumerate(value)]
    return None


def named_leaves(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf of ``value`` with its path, depth first, in container order."""
    children = _children(value)
    if children is None:
        return [(prefix, value)]
    return [leaf for suffix, child in children for leaf in named_leaves(child, prefix + suffix)]


def leaves(value: Any) -> list[Any]:
    """``named_leaves`` without the names."""
    return [leaf for _, leaf in named_leaves(value)]


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` rebuilt with ``fn(t)`` for every tensor ``t``, containers of the same classes.
    A container whose class cannot be rebuilt from its items is returned as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    children = _children(value)
    if children is None:
        return value
    mapped = [map_tensors(fn, child) for _, child in children]
    try:
        if dataclasses.is_dataclass(value):
            fields = [f for f in dataclasses.fields(value)]
            if all(f.init for f in fields):
                return type(value)(**{f.name: m for f, m in zip(fields, mapped)})
            return value
        if isinstance(value, Mapping):
            pairs = dict(zip(value, mapped))
            return pairs if type(value) is dict else type(value)(pairs)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*mapped)
        return type(value)(mapped)
    except Exception:  # a class whose constructor takes something else: keep the original
        return value


def container_types(value: Any) -> Iterator[str]:
    """The qualified class name of every container in ``value``."""
    children = _children(value)
    if children is not None:
        yield type(value).__qualname__
        for _, child in children:
            yield from container_types(child)


def sketch(value: Any) -> str:
    """``value``'s containers with ``*`` for leaves: ``CausalLMOutput(*, (*, *))``."""
    children = _children(value)
    if children is None:
        return "*"
    return f"{type(value).__name__}({', '.join(sketch(child) for _, child in children)})"
