"""Values as recipes: where the tensors are in a nested Python value, and how to rebuild it.

``flatten(value, leaves, where)`` returns the *recipe* of ``value`` (``fxopt.runtime.input_guard``:
``Leaf``, ``Const``, ``Seq``, ``Map``, ``Fields``) and appends its tensors to ``leaves``;
``build(recipe, leaves)`` rebuilds the value around other tensors; ``emit`` writes that
rebuilding as graph code, and ``extract`` the reverse: graph nodes reading each tensor out of a
value. No pytree registration is needed: the containers are rebuilt by calling their classes.

Handled: tensors; ``None``, bool, int, float, str; tuples, lists and namedtuples; dicts and
other ``Mapping`` classes (``OrderedDict`` subclasses such as Hugging Face's ``ModelOutput``)
with str or int keys, rebuilt as ``cls(dict)``; dataclasses whose fields are all ``init=True``,
rebuilt as ``cls(**fields)``. Anything else raises ``Unsupported`` naming where it is. Not
handled: containers whose constructor does not take what these calls give it (a list subclass
with a required extra argument), and objects reached twice (they are rebuilt twice).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from fxopt.runtime.input_guard import PLAIN, Const, Fields, Leaf, Map, Seq


class Unsupported(Exception):
    """A value ``flatten`` has no recipe for: ``where`` it is, and what ``kind`` of value."""

    def __init__(self, where: str, kind: str):
        super().__init__(f"{where} is a {kind}")
        self.where = where
        self.kind = kind


def flatten(value: Any, leaves: list, where: str, *, symbolic: bool = False) -> Any:
    """The recipe of ``value``; its tensors (and, with ``symbolic``, SymInts) go to ``leaves``."""
    if isinstance(value, torch.Tensor) or (
            symbolic and isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))):
        leaves.append(value)
        return Leaf(len(leaves) - 1)
    if type(value) in PLAIN:
        return Const(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        if not all(f.init for f in fields):
            raise Unsupported(where, f"dataclass {type(value).__name__} with init=False fields")
        return Fields(type(value), tuple(f.name for f in fields), tuple(
            flatten(getattr(value, f.name), leaves, f"{where}.{f.name}", symbolic=symbolic)
            for f in fields))
    if isinstance(value, Mapping):
        keys = tuple(value)
        if not all(type(k) in (str, int) for k in keys):
            raise Unsupported(where, f"{type(value).__name__} with keys other than str and int")
        return Map(type(value), keys, tuple(
            flatten(value[k], leaves, f"{where}[{k!r}]", symbolic=symbolic) for k in keys))
    if isinstance(value, (tuple, list)):
        return Seq(type(value), tuple(
            flatten(v, leaves, f"{where}[{i}]", symbolic=symbolic) for i, v in enumerate(value)))
    raise Unsupported(where, type(value).__name__)


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def build(recipe: Any, leaves: list | tuple) -> Any:
    """The Python value ``recipe`` describes, with ``leaves`` in the tensors' places."""
    if isinstance(recipe, Leaf):
        return leaves[recipe.index]
    if isinstance(recipe, Const):
        return recipe.value
    items = [build(item, leaves) for item in recipe.items]
    if isinstance(recipe, Fields):
        return recipe.cls(**dict(zip(recipe.names, items)))
    if isinstance(recipe, Map):
        pairs = dict(zip(recipe.keys, items))
        return pairs if recipe.cls is dict else recipe.cls(pairs)
    if _is_namedtuple(recipe.cls):
        return recipe.cls(*items)
    return recipe.cls(items)


def emit(graph: fx.Graph, recipe: Any, leaves: list) -> Any:
    """``build`` as graph code: an fx argument, with constructor calls for container classes."""
    if isinstance(recipe, Leaf):
        return leaves[recipe.index]
    if isinstance(recipe, Const):
        return recipe.value
    items = [emit(graph, item, leaves) for item in recipe.items]
    if isinstance(recipe, Fields):
        return graph.call_function(recipe.cls, (), dict(zip(recipe.names, items)))
    if isinstance(recipe, Map):
        pairs = dict(zip(recipe.keys, items))
        return pairs if recipe.cls is dict else graph.call_function(recipe.cls, (pairs,))
    if recipe.cls in (tuple, list):
        return recipe.cls(items)
    if _is_namedtuple(recipe.cls):
        return graph.call_function(recipe.cls, tuple(items))
    return graph.call_function(recipe.cls, (tuple(items),))


def extract(graph: fx.Graph, recipe: Any, node: fx.Node, out: dict[int, fx.Node]) -> None:
    """Graph nodes reading each tensor of ``recipe`` out of the value ``node`` holds."""
    if isinstance(recipe, Leaf):
        out[recipe.index] = node
        return
    if isinstance(recipe, Const):
        return
    keys = (recipe.names if isinstance(recipe, Fields) else
            recipe.keys if isinstance(recipe, Map) else range(len(recipe.items)))
    for key, item in zip(keys, recipe.items):
        if _has_leaf(item):
            read = (graph.call_function(getattr, (node, key)) if isinstance(recipe, Fields)
                    else graph.call_function(operator.getitem, (node, key)))
            extract(graph, item, read, out)


def _has_leaf(recipe: Any) -> bool:
    if isinstance(recipe, Leaf):
        return True
    return not isinstance(recipe, Const) and any(_has_leaf(i) for i in recipe.items)


def leaf_paths(given: dict[str, Any]) -> list[str]:
    """Where each tensor of the recipes in ``given`` (name -> recipe) is, by ``Leaf`` index:
    ``input_ids``, ``inputs['x']``, ``batch.labels``."""
    names: dict[int, str] = {}

    def walk(recipe: Any, where: str) -> None:
        if isinstance(recipe, Leaf):
            names[recipe.index] = where
        elif not isinstance(recipe, Const):
            keys = (recipe.names if isinstance(recipe, Fields) else
                    recipe.keys if isinstance(recipe, Map) else range(len(recipe.items)))
            for key, item in zip(keys, recipe.items):
                walk(item, f"{where}.{key}" if isinstance(recipe, Fields) else
                     f"{where}[{key!r}]")

    for name, recipe in given.items():
        walk(recipe, name)
    return [names[i] for i in sorted(names)]

