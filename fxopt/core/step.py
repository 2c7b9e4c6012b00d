"""The one definition of "a training step" used by verify, measure, analysis and benchmarks.

A step is a forward, then one backward from what ``step_loss(output)`` picks:

- **The model's own loss**, when the output carries one (``model_loss``): a value named ``loss``
  in a container fxopt's tree walk knows (``fxopt.core.trees``) at the top of the output -- a
  mapping's key (``{"loss": ..., "logits": ...}``, Hugging Face's ``ModelOutput``), a dataclass
  field or a namedtuple field -- that is a floating tensor with one element that requires grad.
  The step is then ``loss.backward()``: that tensor alone, cotangent 1. This is what the user's
  training loop runs (``model(input_ids=ids, labels=ids).loss.backward()``), so planning,
  prediction, measurement and verification see the memory a real step holds: no cotangent for
  the other outputs (a causal LM's ``batch x sequence x vocab`` logits) and no gradient summed
  from one. The other outputs are still returned (verification compares their forward values);
  the gradients compared are the loss's.
- **Otherwise, every floating output that requires grad**, seeded with deterministic random
  cotangents (drawn from a private generator, so the global RNG and dropout masks are
  untouched). Random cotangents rather than ``out.sum()`` make gradient bugs visible that a
  plain sum would hide (e.g. a permutation of outputs).

Not detected as a loss, on purpose: a plain tuple whose first item is a scalar (Hugging Face's
``return_dict=False`` output; any model may return an auxiliary scalar first), a ``loss`` nested
deeper than the top level, a ``loss`` of several elements (per-sample losses: which reduction
the user applies is unknown) or one that does not require grad (a metric). Those outputs get the
random-cotangent step, as every output did before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fxopt.core.trees import leaves

COTANGENT_SEED = 1234
LOSS = "loss"  # the name a model's own loss goes by in its output


def as_args(example_inputs: Any) -> tuple:
    """Normalise example inputs to a positional-argument tuple."""
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    return (example_inputs,)


def differentiable_outputs(output: Any) -> list[torch.Tensor]:
    return [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


# Elements of a cotangent drawn on the host at a time for an output on another device: the
# host holds at most this many float32 values (64 MiB), not a copy of the whole output.
COTANGENT_CHUNK = 1 << 24


def cotangents_for(outputs: list[torch.Tensor], seed: int = COTANGENT_SEED) -> list[torch.Tensor]:
    """Deterministic cotangents with the shape, dtype and device of each output.

    The values are the same on every device: standard-normal float32 numbers drawn, in output
    order, from a CPU generator seeded with ``seed``, then cast to the output's dtype. (A device
    generator would draw other numbers on CUDA than on the CPU.) For an output on another device
    than the CPU they are drawn in chunks of ``COTANGENT_CHUNK`` elements and copied into a
    tensor made on the output's device, so the host never holds a float32 copy of a large
    output (a ``2 x 2048 x 128256`` logits tensor would be 2 GiB); chunked draws give exactly the
    numbers of one draw (``_draw_into``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [_cotangent(o, gen) for o in outputs]


def _cotangent(o: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if o.device.type == "cpu":
        return torch.randn(o.shape, generator=gen, dtype=torch.float32,
                           device="cpu").to(dtype=o.dtype)
    out = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    _draw_into(out.view(-1), gen, COTANGENT_CHUNK)
    return out


def _draw_into(flat: torch.Tensor, gen: torch.Generator, chunk: int) -> None:
    """Fill the 1-d ``flat`` with ``torch.randn(flat.numel(), generator=gen)``'s numbers, drawn
    on the CPU ``chunk`` elements at a time (``chunk`` a multiple of 16). Exact because the CPU
    normal kernel draws its uniforms in order and turns them into normals 16 at a time, re-drawing
    the last 16 of a length that is no multiple of 16 (or taking another path below 16): so every
    chunk but the last is a multiple of 16 long and the last is at least 16 long (or the whole
    tensor), the numbers and the generator's final state are those of one draw
    (``tests/test_device_safety.py`` checks it against one draw)."""
    n = flat.numel()
    start = 0
    while start < n:
        size = n - start if n - start < chunk + 16 else chunk
        flat[start:start + size].copy_(
            torch.randn(size, generator=gen, dtype=torch.float32, device="cpu"))
        start += size


def _named_loss(output: Any) -> Any:
    """The value named ``loss`` at the top of ``output`` (None when there is none)."""
    if isinstance(output, torch.Tensor):
        return None
    if isinstance(output, Mapping):  # dict, OrderedDict, ModelOutput (which holds no None key)
        return output.get(LOSS)
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        fields = {f.name for f in dataclasses.fields(output)}
        return getattr(output, LOSS) if LOSS in fields else None
    if isinstance(output, tuple) and LOSS in getattr(output, "_fields", ()):
        return getattr(output, LOSS)
    return None


def model_loss(output: Any) -> torch.Tensor | None:
    """The model's own loss in ``output`` (see the module docstring), or None."""
    loss = _named_loss(output)
    if (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1
            and loss.requires_grad):
        return loss
    return None


FROM_LOSS = f"the model's loss (output.{LOSS})"  # ``describe_step`` of a step from the loss


@dataclass(frozen=True)
class StepLoss:
    """What one training step backpropagates from an output: ``tensors`` seeded with
    ``cotangents`` (``torch.autograd.backward(tensors, cotangents)``)."""

    tensors: list[torch.Tensor]
    cotangents: list[torch.Tensor]
    from_loss: bool  # True: the model's own loss, cotangent 1; False: random cotangents

    def describe(self) -> str:
        """``FROM_LOSS``, or ``"random cotangents over 2 outputs"``."""
        if self.from_loss:
            return FROM_LOSS
        return f"random cotangents over {len(self.tensors)} output(s)"


def step_loss(output: Any, seed: int = COTANGENT_SEED) -> StepLoss:
    """What a training step backpropagates from ``output``: the model's loss when it returns
    one (cotangent 1), else every differentiable output with deterministic random cotangents
    (empty when nothing requires grad)."""
    loss = model_loss(output)
    if loss is not None:
        return StepLoss([loss], [torch.ones_like(loss)], True)
    outs = differentiable_outputs(output)
    return StepLoss(outs, cotangents_for(outs, seed), False)


def describe_step(output: Any) -> str:
    """What a step backpropagates from ``output``, in words (``StepLoss.describe``), without
    drawing cotangents."""
    if model_loss(output) is not None:
        return FROM_LOSS
    return StepLoss(differentiable_outputs(output), [], False).describe()


def backward_from(output: Any, seed: int = COTANGENT_SEED) -> bool:
    """Backpropagate what ``step_loss(output)`` picks; returns False when nothing in ``output``
    requires grad."""
    step = step_loss(output, seed)
    if not step.tensors:
        return False
    torch.autograd.backward(step.tensors, step.cotangents)
    return True


def training_step(module: torch.nn.Module, example_inputs: Any, seed: int = COTANGENT_SEED, *,
                  after_forward: Callable[[Any], None] | None = None) -> Any:
    """One forward + backward of ``module`` on ``example_inputs``; returns the forward output.
    ``after_forward(output)`` runs between the two (a prediction tags what forward left)."""
    output = module(*as_args(example_inputs))
    if after_forward is not None:
        after_forward(output)
    backward_from(output, seed)
    return output
