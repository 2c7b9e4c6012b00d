"""What fxopt accepts as example inputs, and the specialisations they imply.

``check_inputs(model, example_inputs, example_kwargs)`` returns forward's positional arguments
or raises an ``InputError`` saying how to call: a tensor, or a tuple/list with one entry per
argument, where an entry may be a tuple, list or dict of tensors, or a plain value (None, bool,
int, float, str). A bare dict is refused: it could mean keyword arguments or one dict argument.
Keyword example inputs (``example_kwargs``, as Hugging Face models are called:
``input_ids=``, ``labels=``) are bound to forward's parameters by name
(``bind_keywords``), so the rest of fxopt sees one positional tuple.

``concrete_args(model, args)`` names the parameters tracing fixes to a value: plain-valued
arguments and trailing ones left out (their defaults). ``refuse_meta_tensors`` stops verify and
measure on tensors that have no values.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from fxopt.core.errors import InputError
from fxopt.core.step import as_args
from fxopt.core.torch_private import tree_leaves
from fxopt.core.wrapped import refuse_wrapped

PLAIN = (type(None), bool, int, float, str)


def check_inputs(model: Any, example_inputs: Any, example_kwargs: dict | None = None) -> tuple:
    """The positional arguments of ``model.forward`` for the call
    ``model(*example_inputs, **example_kwargs)``, or an ``InputError`` saying how to call."""
    if not isinstance(model, nn.Module):
        raise InputError(
            f"fxopt needs a torch.nn.Module, got {type(model).__name__}",
            hint="pass the model object itself (e.g. fxopt.optimize(MyNet(), inputs)).",
        )
    refuse_wrapped(model)
    if isinstance(example_inputs, dict):
        raise InputError(
            "example inputs given as a dict: fxopt takes forward's positional arguments",
            where=f"{type(model).__name__}.forward",
            hint="for keyword arguments pass example_kwargs=the_dict (example_inputs=() when "
            "there are no positional ones); for a forward that takes one dict, wrap it: "
            "(inputs_dict,).",
        )
    args = as_args(example_inputs)
    if example_kwargs:
        args = bind_keywords(model, args, example_kwargs)
    for index, arg in enumerate(args):
        bad = [type(v).__name__ for v in tree_leaves(arg)
               if not isinstance(v, (torch.Tensor, *PLAIN))]
        if bad:
            raise InputError(
                f"example input {index} holds a {bad[0]}, which fxopt cannot pass to the model",
                where=f"example_inputs[{index}]",
                hint="pass tensors (optionally in tuples, lists or dicts) and plain values "
                "(None, bool, int, float, str), e.g. (torch.randn(8, 3, 224, 224),).",
            )
    if not any(isinstance(v, torch.Tensor) for v in tree_leaves(list(args))):
        kinds = ", ".join(type(a).__name__ for a in args) or "nothing"
        raise InputError(
            f"example inputs must be a tensor or a tuple of tensors, got ({kinds})",
            hint="pass the positional tensors forward() takes, e.g. (torch.randn(8, 3, 224, 224),).",
        )
    return args


def bind_keywords(model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """``model(*args, **kwargs)`` as one positional call: every keyword is put at its
    parameter's place in forward's signature (followed through ``functools.wraps`` decorators),
    and a parameter skipped before the last one given takes its signature default.

    Safe for a forward whose skipped parameters behave as their defaults when passed explicitly
    (true of plain Python, and of Hugging Face's decorators, which read their own options from
    ``**kwargs``). Not handled (``InputError``): keywords that only ``**kwargs`` takes, a keyword
    also given positionally, a skipped parameter with no default, keyword-only parameters.
    """
    name = type(model).__name__
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InputError(f"example_kwargs must be a dict of argument names to values, got "
                         f"{type(kwargs).__name__}", where=f"{name}.forward",
                         hint="pass e.g. example_kwargs={'input_ids': ids, 'labels': ids}")
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError) as error:
        raise InputError(f"{name}.forward has no signature fxopt can bind keywords to: {error}",
                         where=f"{name}.forward",
                         hint="pass the inputs positionally, in forward's order") from None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    places = {p.name: i for i, p in enumerate(positional)}
    for key in kwargs:
        if key not in places:
            only = ("only through **kwargs" if any(p.kind == p.VAR_KEYWORD for p in parameters)
                    and key not in {p.name for p in parameters} else "as keyword-only")
            raise InputError(
                f"{name}.forward takes {key!r} {only}, or not at all; fxopt binds keyword "
                "example inputs to forward's named positional parameters",
                where=f"{name}.forward",
                hint=f"forward's parameters are: {', '.join(places) or 'none'}; leave "
                f"{key!r} to its default or set it on the model (e.g. its config)")
        if places[key] < len(args):
            raise InputError(f"example input {key!r} is given both positionally and by keyword",
                             where=f"{name}.forward", hint="give it once")
    last = max(places[key] for key in kwargs)
    bound = list(args)
    for param in positional[len(args):last + 1]:
        if param.name in kwargs:
            bound.append(kwargs[param.name])
        elif param.default is not param.empty:
            bound.append(param.default)
        else:
            raise InputError(f"{name}.forward needs argument {param.name!r}, which the example "
                             "inputs do not give", where=f"{name}.forward",
                             hint=f"add {param.name}=... to example_kwargs")
    return tuple(bound)


def concrete_args(model: nn.Module, args: tuple) -> dict[str, Any]:
    """forward's parameters to specialise: plain-valued ones, and those left to their defaults."""
    try:
        parameters = list(inspect.signature(type(model).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return {}  # forward(*args): fx makes one placeholder for all of them
    if len(args) > len(positional):
        raise InputError(
            f"{type(model).__name__}.forward takes {len(positional)} positional argument(s) "
            f"({', '.join(p.name for p in positional)}), the example inputs give {len(args)}",
            where=f"{type(model).__name__}.forward", hint="pass one example value per argument")
    concrete: dict[str, Any] = {}
    for param, value in zip(positional, args):
        if isinstance(value, PLAIN):
            concrete[param.name] = value
    for param in positional[len(args):] + [p for p in parameters if p.kind == p.KEYWORD_ONLY]:
        if param.default is param.empty:
            raise InputError(
                f"{type(model).__name__}.forward needs argument {param.name!r}, which the "
                "example inputs do not give",
                where=f"{type(model).__name__}.forward",
                hint="pass every required argument positionally, in forward's order "
                "(keyword-only arguments need defaults).")
        concrete[param.name] = param.default
    return concrete


def refuse_meta_tensors(what: str, module: nn.Module, args: Any) -> None:
    """``InputError`` when the model or the inputs live on the meta device (no values)."""
    tensors = [*module.parameters(), *module.buffers(),
               *(t for t in tree_leaves(args) if isinstance(t, torch.Tensor))]
    if any(t.device.type == "meta" for t in tensors):
        raise InputError(
            f"{what}: the model or its inputs are on the meta device, which holds no values, "
            f"so {what} cannot run them",
            where=f"{type(module).__name__}",
            hint="materialise the model first (model.to_empty(device='cpu') and load weights), "
            "or call fxopt.optimize(..., verify=False) without measure_memory to only rewrite "
            "and analyse it")
