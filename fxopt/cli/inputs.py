"""Example inputs described on the command line: ``--input``, ``--input-shape``, ``--int-range``.

An ``--input`` spec describes one tensor (repeat ``--input`` for several)::

    [NAME=]SHAPE[:DTYPE[:LOW-HIGH]]      e.g. 8,3,224,224   input_ids=4,256:int64:0-50257
    NAME=@OTHER                          e.g. labels=@input_ids (the same tensor as input_ids)

- SHAPE: positive sizes separated by commas or ``x`` (``8,3,224,224`` or ``8x3x224x224``).
- DTYPE: one of ``INPUT_DTYPES``; default ``--dtype``.
- LOW-HIGH: values drawn uniformly from [LOW, HIGH), HIGH excluded as in ``torch.randint``: token
  ids of a 50257-word vocabulary are ``0-50257``; an attention mask of ones is ``1-2``. Integers for
  integer dtypes, decimals allowed for float dtypes (``0-1`` gives pixels in [0, 1)); a negative
  LOW is written ``-1-1``. Without it, floats are standard normal and integers come from
  ``--int-range`` (default 0-2, zeros and ones: give the vocabulary size for token ids).
- ``NAME=``: a keyword argument of forward, bound to forward's parameter of that name as
  ``fxopt.optimize(example_kwargs=...)`` binds it; without a name the input is positional, in the
  order given. Positional specs come before keyword ones in the call, wherever they are written.

Every tensor is drawn from one ``torch.Generator`` seeded 0, in the order given: the same command
line gives the same inputs. Not handled here (save them with ``torch.save`` and pass ``--inputs
FILE``): nested inputs (a tuple or dict inside one argument), plain values (None, numbers, strings),
and tensors whose values must satisfy more than a range (sorted, one-hot, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fxopt.core.errors import InputError

INPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
                "bool": torch.bool}
DEFAULT_INT_RANGE = (0, 2)
SPEC_FORM = "[NAME=]SHAPE[:DTYPE[:LOW-HIGH]] or NAME=@OTHER"
_NUMBER = r"-?\d+(?:\.\d+)?"
_RANGE = re.compile(rf"^({_NUMBER})-({_NUMBER})$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class InputSpec:
    """One ``--input``: a tensor to draw (``shape``) or another input to reuse (``same_as``)."""

    text: str
    name: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    value_range: tuple[float, float] | None = None
    same_as: str | None = None


def parse_shape(text: str, option: str = "--input-shape") -> tuple[int, ...]:
    """``"8,3,224,224"`` or ``"8x3x224x224"`` -> ``(8, 3, 224, 224)``; sizes must be positive."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise InputError(f"bad {option} {text!r}", where=option,
                         hint="write positive sizes: 8,3,224,224")
    return shape


def parse_int_range(text: str) -> tuple[int, int]:
    """``--int-range LOW,HIGH`` -> ``(LOW, HIGH)``, integers drawn from [LOW, HIGH)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        low, high = (int(p) for p in parts)
    except ValueError:
        raise InputError(f"bad --int-range {text!r}", where="--int-range",
                         hint="write LOW,HIGH with HIGH excluded, e.g. 0,50257 for token ids "
                              "of a 50257-word vocabulary") from None
    if low >= high:
        raise InputError(f"bad --int-range {text!r}: LOW must be below HIGH", where="--int-range",
                         hint="HIGH is excluded: 0,2 gives zeros and ones")
    return low, high


def parse_input_spec(text: str) -> InputSpec:
    """One ``--input`` spec (the module docstring's grammar), or an ``InputError`` naming it."""
    where = f"--input {text}"
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = None, text
    elif not _NAME.match(name):
        raise InputError(f"bad input name {name!r} in --input {text!r}", where=where,
                         hint="a keyword input is NAME=SHAPE with NAME a forward() parameter, "
                              "e.g. input_ids=4,256:int64:0-50257")
    if rest.startswith("@"):
        if name is None or not _NAME.match(rest[1:]):
            raise InputError(f"bad --input {text!r}", where=where,
                             hint="reuse a named input as NAME=@OTHER, e.g. labels=@input_ids")
        return InputSpec(text, name=name, same_as=rest[1:])
    shape_text, _, tail = rest.partition(":")
    dtype, _, range_text = tail.partition(":")
    shape = parse_shape(shape_text, "--input")
    if dtype and dtype not in INPUT_DTYPES:
        raise InputError(f"unknown dtype {dtype!r} in --input {text!r}", where=where,
                         hint=f"use one of: {', '.join(INPUT_DTYPES)}")
    return InputSpec(text, name=name, shape=shape, dtype=dtype or None,
                     value_range=_parse_range(range_text, dtype, where) if range_text else None)


def _parse_range(text: str, dtype: str, where: str) -> tuple[float, float]:
    match = _RANGE.match(text)
    if not match:
        raise InputError(f"bad value range {text!r} in {where}", where=where,
                         hint="write LOW-HIGH with HIGH excluded: 0-50257 (token ids), 0-1 "
                              "(floats in [0, 1)), -1-1")
    low, high = float(match.group(1)), float(match.group(2))
    if dtype == "bool":
        raise InputError(f"a bool input takes no value range ({where})", where=where,
                         hint="drop the range, or use int64 with 0-2")
    integral = dtype not in ("", "float32", "float16", "bfloat16", "float64")
    if integral and not (low.is_integer() and high.is_integer()):
        raise InputError(f"an integer input needs an integer range, got {text!r}", where=where,
                         hint="e.g. 0-50257")
    if low >= high:
        raise InputError(f"bad value range {text!r}: LOW must be below HIGH", where=where,
                         hint="HIGH is excluded: 0-2 gives zeros and ones")
    return low, high


def draw(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
         value_range: tuple[float, float] | None = None,
         int_range: tuple[int, int] | None = None) -> torch.Tensor:
    """A CPU tensor drawn from ``gen`` (a CPU generator; the CPU whatever the default device is,
    so the same numbers everywhere): floats standard normal or uniform in ``value_range``,
    integers uniform in ``value_range`` else ``int_range`` else ``DEFAULT_INT_RANGE``, bools 0/1."""
    cpu = torch.device("cpu")
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, device=cpu).bool()
    if dtype.is_floating_point:
        if value_range is None:
            return torch.randn(shape, generator=gen, device=cpu).to(dtype)
        low, high = value_range
        unit = torch.rand(shape, generator=gen, dtype=torch.float64, device=cpu)
        return (unit * (high - low) + low).to(dtype)
    low, high = value_range or int_range or DEFAULT_INT_RANGE
    return torch.randint(int(low), int(high), shape, generator=gen, dtype=dtype, device=cpu)


def make_inputs(specs: list[InputSpec], *, default_dtype: str = "float32",
                int_range: tuple[int, int] | None = None) -> tuple[tuple, dict]:
    """``(positional args, keyword args)`` for ``specs``, drawn in order from a generator seeded 0.

    ``default_dtype`` is the dtype of a spec that names none. A name given twice, or ``@OTHER``
    naming an input not defined before it, is an ``InputError``."""
    gen = torch.Generator().manual_seed(0)
    args: list[torch.Tensor] = []
    kwargs: dict[str, torch.Tensor] = {}
    for spec in specs:
        where = f"--input {spec.text}"
        if spec.name in kwargs:
            raise InputError(f"input {spec.name!r} is given twice", where=where,
                             hint="give each keyword input once")
        if spec.same_as is not None:
            if spec.same_as not in kwargs:
                raise InputError(f"--input {spec.text!r} reuses {spec.same_as!r}, which no "
                                 "--input before it names", where=where,
                                 hint=f"write --input {spec.same_as}=SHAPE... before this one")
            kwargs[spec.name] = kwargs[spec.same_as]
            continue
        assert spec.shape is not None
        tensor = draw(spec.shape, INPUT_DTYPES[spec.dtype or default_dtype], gen,
                      spec.value_range, int_range)
        if spec.name is None:
            args.append(tensor)
        else:
            kwargs[spec.name] = tensor
    return tuple(args), kwargs

