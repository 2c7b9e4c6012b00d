"""Resolve a CLI TARGET to a model and example inputs.

TARGET is ``zoo:NAME`` (a models_zoo entry), ``eco:NAME`` (a ``models_zoo.ecosystem`` model:
Hugging Face, diffusers, smp, monai, timm; the ``test`` extra), ``path/to/file.py:NAME`` or
``package.module:NAME``, where NAME is an nn.Module subclass or a factory returning a module
(called with no arguments).

Example inputs: the zoo's, ``--input-shape``, or ``--inputs FILE`` (``torch.save`` of a tensor, a
tuple or list of forward's positional arguments, or a dict of its keyword arguments, as Hugging
Face models are called). Keyword inputs are bound to forward's parameters by name
(``fxopt.core.inputs.check_inputs``), so every command sees one positional tuple.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import models_zoo
from fxopt.core.errors import InputError
from fxopt.core.inputs import check_inputs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int64": torch.int64}


def _load_module(spec: str) -> Any:
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        if not path.is_file():
            raise InputError(f"TARGET not found: no file {spec}",
                             hint="give path/to/file.py:ClassOrFactory, package.module:factory "
                             "or zoo:NAME")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec and module_spec.loader
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(path.stem, module)
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(spec)
    except ImportError as error:
        raise InputError(f"TARGET not found: cannot import {spec}: {error}",
                         hint="check the module path and that it is importable "
                         "(on PYTHONPATH)") from error


def _instantiate(obj: Any, where: str) -> nn.Module:
    model = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    if not isinstance(model, nn.Module):
        raise InputError(f"TARGET {where} gave a {type(model).__name__}, not an nn.Module",
                         hint="point TARGET at an nn.Module class or a factory returning one")
    return model


def load_inputs(path: str, model: nn.Module) -> tuple:
    """forward's positional arguments from a ``torch.save``d tensor, tuple, list or dict (keyword
    arguments)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as error:  # pickle errors derive from these
        raise InputError(f"cannot read --inputs {path}: {type(error).__name__}: {error}",
                         where="--inputs",
                         hint="save the inputs with torch.save: a tensor, a tuple of forward's "
                              "positional arguments, or a dict of its keyword arguments") from None
    if isinstance(saved, dict):
        return check_inputs(model, (), saved)
    return check_inputs(model, saved)


def load_target(target: str, *, input_shape: tuple[int, ...] | None = None,
                dtype: str = "float32", weights: str | None = None,
                inputs_file: str | None = None) -> tuple[nn.Module, tuple]:
    """Return ``(model, example_inputs)`` for a CLI TARGET."""
    if target.startswith("eco:"):
        from models_zoo import ecosystem
        entry = ecosystem.get(target[4:])
        model = entry.build()
        args, kwargs = entry.inputs(input_shape[0] if input_shape else entry.default_batch)
        inputs = check_inputs(model, args, kwargs)
    elif target.startswith("zoo:"):
        entry = models_zoo.get(target[4:])
        model = entry.build()
        inputs = entry.example_inputs(input_shape[0] if input_shape else entry.default_batch)
        if input_shape and tuple(inputs[0].shape) != tuple(input_shape):
            inputs = (_make_input(input_shape, inputs[0].dtype, like=inputs[0]),) + tuple(inputs[1:])
    else:
        module_spec, sep, name = target.rpartition(":")
        if not sep or not module_spec or not name:
            raise InputError(f"cannot read TARGET {target!r}",
                             hint="write path/to/file.py:ClassOrFactory, package.module:factory "
                             "or zoo:NAME")
        module = _load_module(module_spec)
        if not hasattr(module, name):
            close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")])
            raise InputError(
                f"TARGET not found: {module_spec} has no attribute {name!r}"
                + (f"; did you mean {close[0]!r}?" if close else ""),
                hint="name an nn.Module class or a factory function defined in that file",
            )
        model = _instantiate(getattr(module, name), target)
        if input_shape is None and inputs_file is None:
            raise InputError(f"TARGET {target} needs --input-shape",
                             hint="e.g. --input-shape 8,3,224,224, or --inputs inputs.pt")
        inputs = (_make_input(input_shape, DTYPES[dtype]),) if input_shape else ()
    if inputs_file:
        inputs = load_inputs(inputs_file, model)
    if weights:
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    if dtype in ("float16", "bfloat16", "float64"):
        model = model.to(DTYPES[dtype])
        inputs = tuple(t.to(DTYPES[dtype]) if isinstance(t, torch.Tensor) and t.is_floating_point()
                       else t for t in inputs)
    return model, inputs


def _make_input(shape: tuple[int, ...], dtype: torch.dtype,
                like: torch.Tensor | None = None) -> torch.Tensor:
    """A deterministic input; integer inputs (token ids) stay within the example's range."""
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    high = int(like.max()) + 1 if like is not None and like.numel() else 2
    return torch.randint(0, high, shape, generator=gen).to(dtype)


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise InputError(f"bad --input-shape {text!r}", hint="write positive sizes: 8,3,224,224")
    return shape
