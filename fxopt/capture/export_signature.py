"""forward's signature for ``capture_with_export``: the example call, and the captured module's.

``bind_example(model, args, kwargs)`` binds the example call to ``model.forward``'s signature
and turns each argument into a recipe (``fxopt.capture.recipes``), its tensors flat in order;
``signature_placeholders(...)`` lists the parameters the captured module takes, with their
defaults.

Safe for any forward whose inputs have names (``functools.wraps`` around a ``*args, **kwargs``
decorator keeps them). Not handled: inputs reaching ``*args``/``**kwargs`` (``TraceError``), and
defaults of skipped parameters other than plain values (``TraceError``: pass them explicitly).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from fxopt.capture.recipes import Unsupported, flatten
from fxopt.core.errors import InputError, TraceError
from fxopt.runtime.input_guard import PLAIN, Const, describe


@dataclass
class Placeholder:
    """One parameter of the captured module's forward."""

    name: str
    recipe: Any  # what the example held (or the default it was captured at)
    default: Any = inspect.Parameter.empty


def signature_placeholders(model_name: str, signature: inspect.Signature,
                           given: dict[str, Any]) -> list[Placeholder]:
    """forward's parameters the graph takes, in forward's order.

    Parameters after the last one given are left out (calling with one is a TypeError): the
    model used its own default, which a decorator may set differently from what the signature
    says. A parameter skipped before a given one keeps its place, at its default, so positional
    calls bind as they do on the model; the guard refuses any other value. So does a parameter
    given its own plain default (keyword example inputs bound to their places pass every
    parameter before the last one given). Any other given parameter has no default unless Python needs one after a defaulted parameter; that default is None, which
    the guard refuses unless None was captured.
    """
    params = [p for p in signature.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    last = max(i for i, p in enumerate(params) if p.name in given)
    result: list[Placeholder] = []
    for param in params[:last + 1]:
        if param.name in given and _is_default(given[param.name], param):
            result.append(Placeholder(param.name, given[param.name], param.default))
        elif param.name in given:
            default = None if any(p.default is not param.empty for p in result) else param.empty
            result.append(Placeholder(param.name, given[param.name], default))
        elif param.default is not param.empty and type(param.default) in PLAIN:
            result.append(Placeholder(param.name, Const(param.default), param.default))
        else:
            raise TraceError(
                f"{model_name}.forward's argument {param.name!r} comes before arguments the "
                f"example gives, and its default ({describe(param.default)}) cannot be written "
                "in the captured module's signature", where=f"{model_name}.forward{signature}",
                hint=f"pass {param.name} explicitly in the example inputs")
    return result


def _is_default(recipe: Any, param: inspect.Parameter) -> bool:
    """Whether the example passed ``param`` its own plain default (as ``fxopt.optimize`` does for
    parameters skipped before a keyword input), so the captured module can default it too."""
    return (isinstance(recipe, Const) and param.default is not param.empty
            and type(param.default) in PLAIN and type(recipe.value) is type(param.default)
            and recipe.value == param.default)


def bind_example(model: nn.Module, args: tuple, kwargs: dict[str, Any]
          ) -> tuple[inspect.Signature, dict[str, Any], dict[str, Any], list]:
    """forward's signature, each given argument's recipe, and the example tensors, flat."""
    name = type(model).__name__
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise InputError(f"{name}.forward cannot be called with these example inputs: {error}",
                         where=f"{name}.forward",
                         hint="pass args as a tuple of forward's positional arguments and kwargs "
                              "as a dict of its keyword arguments") from error
    variadic = [p.name for p in signature.parameters.values()
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name in bound.arguments]
    if variadic:
        raise TraceError(
            f"{name}.forward takes *{variadic[0]}, which the example inputs reach: fxopt needs a "
            "named parameter for every input it captures",
            where=f"{name}.forward{signature}",
            hint="give forward named parameters, or wrap it with functools.wraps so its "
                 "signature names them")
    leaves: list = []
    given: dict[str, Any] = {}
    for arg_name, value in bound.arguments.items():
        try:
            given[arg_name] = flatten(value, leaves, arg_name)
        except Unsupported as error:
            raise InputError(
                f"example input {error.where} is a {error.kind}, which fxopt cannot pass to "
                "torch.export", where=f"{name}.forward argument {error.where}",
                hint="pass tensors, plain values (None, bool, int, float, str) and tuples, "
                     "lists, dicts and dataclasses of them") from error
    if not leaves:
        raise InputError("the example inputs contain no tensor", where=f"{name}.forward",
                         hint="pass the tensors forward takes, e.g. (torch.randn(8, 3, 32, 32),)")
    return signature, bound.arguments, given, leaves
