"""Resolve a CLI TARGET to a model and example inputs.

TARGET is ``zoo:NAME`` (a models_zoo entry), ``eco:NAME`` (a ``models_zoo.ecosystem`` model:
Hugging Face, diffusers, smp, monai, timm; the ``test`` extra), ``path/to/file.py:NAME`` or
``package.module:NAME``. NAME is an nn.Module subclass, a module object, or a factory called with
no arguments that returns a module, ``(model, inputs)`` (a tensor or a tuple/list of positional
arguments), ``(model, {"input_ids": ...})`` (keyword arguments) or ``(model, args, kwargs)``.

Example inputs, one source at a time:

- the target's own (zoo and eco entries, a factory that returns inputs);
- ``--input-shape``: one positional tensor of ``--dtype``; for zoo and factory targets it replaces
  the first positional input (same dtype; integers keep its range unless ``--int-range``), for eco
  targets only its batch size is read;
- ``--input SPEC`` (repeatable, ``fxopt.cli.inputs``): several tensors, positional or keyword,
  with shapes, dtypes and value ranges;
- ``--inputs FILE``: a ``torch.save`` of a tensor, a tuple or list of forward's positional
  arguments, or a dict of its keyword arguments.

Keyword inputs are bound to forward's parameters by name (``fxopt.core.inputs.check_inputs``), so
every command sees one positional tuple. ``--weights`` is loaded on the CPU, then ``--dtype``
(float16, bfloat16, float64) casts the model and the float inputs, then ``--device`` moves both.
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

import fxopt.models_zoo as models_zoo
from fxopt.cli.device import to_device
from fxopt.cli.inputs import DEFAULT_INT_RANGE, INPUT_DTYPES, InputSpec, draw, make_inputs
from fxopt.core.errors import InputError
from fxopt.core.inputs import check_inputs, refuse_meta_tensors
from fxopt.core.step import as_args

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int64": torch.int64}
TARGET_FORMS = "zoo:NAME, eco:NAME, path/to/file.py:ClassOrFactory or package.module:factory"
Given = tuple[tuple, dict] | None  # a target's own (args, kwargs), or None when it has none


def _load_module(spec: str) -> Any:
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        if not path.is_file():
            raise InputError(f"TARGET not found: no file {spec}", hint=f"give {TARGET_FORMS}")
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


def _call(obj: Any, where: str) -> Any:
    """``obj()`` for a class or factory, ``obj`` for a module object; the user's own exception
    becomes an InputError naming the target."""
    if isinstance(obj, nn.Module) or not callable(obj):
        return obj
    try:
        return obj()
    except Exception as error:
        raise InputError(f"TARGET {where} raised {type(error).__name__}: {error}", where=where,
                         hint="TARGET is called without arguments: give a class whose "
                              "constructor needs none, or a factory function") from error


def _instantiate(obj: Any, where: str) -> tuple[nn.Module, Given]:
    """The model, and the inputs a factory returned with it: ``(model, inputs)``,
    ``(model, kwargs_dict)`` or ``(model, args, kwargs)``."""
    result = _call(obj, where)
    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], nn.Module):
        model, rest = result[0], tuple(result[1:])
        if len(rest) == 1:
            return model, (((), rest[0]) if isinstance(rest[0], dict) else (as_args(rest[0]), {}))
        if len(rest) == 2 and isinstance(rest[1], dict):
            return model, (as_args(rest[0]), rest[1])
    kind = (f"a {type(result).__name__} of {len(result)} items"
            if isinstance(result, (tuple, list)) else f"a value of type {type(result).__name__}")
    raise InputError(f"TARGET {where} gave {kind}, not an nn.Module or (model, inputs)",
                     where=where,
                     hint="return a module, (model, inputs), (model, {'name': tensor, ...}) "
                          "or (model, args_tuple, kwargs_dict)")


def _refuse_meta(target: str, model: nn.Module, inputs: tuple) -> None:
    """Every command runs the model for real (verification, measurement, timing): a model or
    inputs on the meta device, which hold no values, are refused before anything is moved."""
    try:
        refuse_meta_tensors(f"fxopt on {target}", model, inputs)
    except InputError as error:
        raise InputError(error.what, where=f"TARGET {target} ({error.where})",
                         hint="materialise the model first (model.to_empty(device='cpu'), then "
                              "load its weights, e.g. with --weights), or rewrite it from Python "
                              "with fxopt.optimize(..., verify=False), which runs nothing"
                         ) from None


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


def _resolve(target: str, batch: int | None) -> tuple[nn.Module, Given]:
    """The model and the target's own inputs (None for a class or a factory of a module)."""
    if target.startswith("eco:"):
        from fxopt.models_zoo import ecosystem
        entry = ecosystem.get(target[4:])
        return entry.build(), entry.inputs(batch or entry.default_batch)
    if target.startswith("zoo:"):
        entry = models_zoo.get(target[4:])
        return entry.build(), (entry.example_inputs(batch or entry.default_batch), {})
    module_spec, sep, name = target.rpartition(":")
    if not sep or not module_spec or not name:
        raise InputError(f"cannot read TARGET {target!r}", hint=f"write {TARGET_FORMS}")
    module = _load_module(module_spec)
    if not hasattr(module, name):
        close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")])
        raise InputError(
            f"TARGET not found: {module_spec} has no attribute {name!r}"
            + (f"; did you mean {close[0]!r}?" if close else ""),
            hint="name an nn.Module class or a factory function defined in that file",
        )
    return _instantiate(getattr(module, name), target)


def _refuse_several_sources(input_shape: Any, input_specs: Any, inputs_file: Any) -> None:
    given = [option for option, value in (("--input-shape", input_shape), ("--input", input_specs),
                                          ("--inputs", inputs_file)) if value]
    if len(given) > 1:
        raise InputError(f"{' and '.join(given)} {'both' if len(given) == 2 else 'all'} "
                         "describe the example inputs",
                         where="command line",
                         hint="give one: --input-shape for one tensor, --input (repeatable) for "
                              "several or keyword ones, --inputs FILE for saved tensors")


def _reshaped_first(args: tuple, shape: tuple[int, ...], int_range: tuple[int, int] | None,
                    target: str) -> tuple:
    """``args`` with its first positional tensor redrawn at ``shape`` (same dtype; integers keep
    the original's range [0, max] unless ``int_range``)."""
    if not args or not isinstance(args[0], torch.Tensor):
        raise InputError(f"--input-shape replaces the first positional input of {target}, "
                         "which has none", where="--input-shape",
                         hint="describe keyword inputs with --input NAME=SHAPE[:DTYPE[:LOW-HIGH]]")
    like = args[0]
    if tuple(like.shape) == tuple(shape) and int_range is None:
        return args
    if int_range is None and not like.is_floating_point() and like.dtype != torch.bool:
        int_range = (0, int(like.max()) + 1 if like.numel() else DEFAULT_INT_RANGE[1])
    gen = torch.Generator().manual_seed(0)
    return (draw(shape, like.dtype, gen, int_range=int_range),) + tuple(args[1:])


def _drawn_integers(dtypes: list[torch.dtype]) -> bool:
    return any(not d.is_floating_point and d != torch.bool for d in dtypes)


def _choose_inputs(model: nn.Module, target: str, given: Given, *, input_shape: Any,
                   input_specs: list[InputSpec], inputs_file: str | None, dtype: str,
                   int_range: tuple[int, int] | None) -> tuple:
    drawn: list[torch.dtype] = []  # dtypes of the tensors drawn here, for --int-range's check
    if inputs_file:
        inputs = load_inputs(inputs_file, model)
    elif input_specs:
        args, kwargs = make_inputs(input_specs, default_dtype=dtype, int_range=int_range)
        drawn = [INPUT_DTYPES[s.dtype or dtype] for s in input_specs if s.shape]
        _note_default_range(input_specs, dtype, int_range)
        inputs = check_inputs(model, args, kwargs)
    elif given is not None:
        args, kwargs = given
        if input_shape and not target.startswith("eco:"):
            args = _reshaped_first(args, input_shape, int_range, target)
            drawn = [args[0].dtype]
        inputs = check_inputs(model, args, kwargs)
    elif input_shape:
        drawn = [DTYPES[dtype]]
        inputs = (draw(input_shape, DTYPES[dtype], torch.Generator().manual_seed(0),
                       int_range=int_range),)
        if int_range is None and _drawn_integers(drawn):
            _note(f"the {dtype} input is drawn from 0-1 (zeros and ones)")
    else:
        raise InputError(f"TARGET {target} needs example inputs", where="command line",
                         hint="e.g. --input-shape 8,3,224,224, --input 4,256:int64:0-50257 "
                              "(repeatable), --inputs inputs.pt, or a factory returning "
                              "(model, inputs)")
    if int_range is not None and not _drawn_integers(drawn):
        raise InputError("--int-range has no integer input to apply to", where="--int-range",
                         hint="it sets the range of integer tensors fxopt draws: with "
                              "--dtype int64 --input-shape, or --input SHAPE:int64 without a "
                              "range of its own")
    return inputs


def _note(text: str) -> None:
    print(f"fxopt: note: {text}; for token ids give the vocabulary: --int-range 0,VOCAB or "
          "--input NAME=SHAPE:int64:0-VOCAB", file=sys.stderr)


def _note_default_range(specs: list[InputSpec], dtype: str,
                        int_range: tuple[int, int] | None) -> None:
    """Say which integer inputs got the default range 0-2 (the result of forgetting one)."""
    if int_range is not None:
        return
    plain = [s.text for s in specs if s.shape and s.value_range is None
             and _drawn_integers([INPUT_DTYPES[s.dtype or dtype]])]
    if plain:
        _note(f"--input {', '.join(plain)}: integers drawn from 0-1 (zeros and ones)")


def load_target(target: str, *, input_shape: tuple[int, ...] | None = None,
                dtype: str = "float32", weights: str | None = None,
                inputs_file: str | None = None, input_specs: list[InputSpec] | None = None,
                int_range: tuple[int, int] | None = None,
                device: torch.device | str = "cpu") -> tuple[nn.Module, tuple]:
    """Return ``(model, example_inputs)`` for a CLI TARGET, on ``device`` (already checked by
    ``fxopt.cli.device.parse_device``)."""
    specs = list(input_specs or [])
    _refuse_several_sources(input_shape, specs, inputs_file)
    model, given = _resolve(target, input_shape[0] if input_shape else None)
    inputs = _choose_inputs(model, target, given, input_shape=input_shape, input_specs=specs,
                            inputs_file=inputs_file, dtype=dtype, int_range=int_range)
    if weights:
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    _refuse_meta(target, model, inputs)
    if dtype in ("float16", "bfloat16", "float64"):
        model = model.to(DTYPES[dtype])
        inputs = tuple(t.to(DTYPES[dtype]) if isinstance(t, torch.Tensor) and t.is_floating_point()
                       else t for t in inputs)
    return to_device(model, inputs, torch.device(device))
