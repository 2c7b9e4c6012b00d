"""The review comments the seed documents would make about a model, as ``Lint`` records.

Pure functions over a traced GraphModule (``meta["val"]`` on its nodes, see ``fxopt.trace``);
nothing is run or changed. Each lint cites the tip it comes from (``/work/shared/seeds``):

- ``large-linear`` (memory): a Linear layer holding at least ``share`` (default half) of all
  parameter bytes, and at least ``min_bytes`` (default 1 MiB: a small model is in no danger). PyTorch FAQ on out-of-memory, "Don't use linear layers that are too large".
- ``batchnorm-small-batch`` (training): a BatchNorm in train mode that sees a per-device batch
  below 8. Memory-saving tricks (zhihu), basic checklist: "when the batch size on each GPU is too
  small (<8), batch_norm makes training unstable, unless you use SyncBatchNorm".
- ``not-multiple-of-8`` (speed): conv channels, Linear features and the batch size that are not
  multiples of 8. PyTorch tips and tricks, tip 9 "Set the sizes of all different architectural
  designs and batch sizes as the multiples of 8". A layer's input size that comes straight from
  the model input (3 colour channels) and its output size that goes straight to the model output
  (10 classes) are fixed by the data and not reported.
- ``train-mode-for-inference`` (correctness): Dropout or BatchNorm modules in train mode when the
  model is meant for inference (``for_inference=True``), or inside a model that is itself in
  eval mode (a submodule switched back to train). "Tips, tricks and gotchas in PyTorch", tip 5
  "Model eval mode and torch.no_grad()"; Grokking PyTorch: "networks should explicitly be set to
  evaluation mode using .eval()".
- ``functional-dropout-always-on`` (correctness): ``F.dropout(x, p)`` without
  ``training=self.training`` drops out even after ``model.eval()`` (its default is
  ``training=True``); same tips as above.

Not handled: layers inside opaque leaves (only the leaf as a whole is seen), functional
``F.linear``/``F.conv2d`` with weights passed in, and BatchNorm batch sizes under data
parallelism (the example inputs are taken to be the per-device batch).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

import fxopt.passes as passes
from fxopt.capture.trace_checks import is_user_file
from fxopt.core.tensors import storage_bytes
from fxopt.core.torch_private import BatchNormBase, DropoutBase
from fxopt.measure.peaks import format_bytes

# The public write-up each lint comes from, as users read them. Developer note, never printed:
# these are the tip collections under /work/shared/seeds -- large-linear 003,
# batchnorm-small-batch 004, not-multiple-of-8 001, train-mode-for-inference 000 and 002,
# functional-dropout-always-on 000.
TIPS = {
    "large-linear": "PyTorch FAQ, \"My model reports 'cuda runtime error(2): out of memory'\": "
                    "\"Don't use linear layers that are too large. A linear layer nn.Linear(m, n) "
                    "uses O(nm) memory\"",
    "batchnorm-small-batch": "\"What memory-saving tricks does PyTorch have?\" (Zhihu), basic "
                             "checklist: with a batch_size per GPU below 8, batch_norm makes "
                             "training unstable unless you use sync_bn",
    "not-multiple-of-8": "\"PyTorch tips and tricks\", tip 9: \"Set the sizes of all different "
                         "architectural designs and batch sizes as the multiples of 8\"",
    "train-mode-for-inference": "\"Tips, tricks and gotchas in PyTorch\", tip 5: \"Model eval mode "
                                "and torch.no_grad()\"; \"Grokking PyTorch\": set networks to "
                                "evaluation mode with .eval()",
    "functional-dropout-always-on": "\"Tips, tricks and gotchas in PyTorch\", tip 5: \"usually "
                                    "one wants to apply dropout only during training\"",
}
_WEIGHTED = (nn.Linear, nn.modules.conv._ConvNd)
_FUNCTIONAL_DROPOUT = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                       F.feature_alpha_dropout, torch.dropout, torch.nn.functional.dropout}
_MODE_AWARE = re.compile(r"\btraining\s*=|\.training\b")  # training=..., self.training


@dataclass(frozen=True)
class Lint:
    code: str       # one of TIPS
    kind: str       # "memory" | "speed" | "training" | "correctness"
    where: str      # module path or node name
    message: str    # what is wrong, with figures
    hint: str       # what to do
    tip: str        # the published tip it comes from (TIPS)

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.where}: {self.message}\n    what to do: {self.hint}\n" \
               f"    tip: {self.tip}"


def grouped(lints: list[Lint], *, shown: int = 4) -> list[Lint]:
    """``lints`` with those that say the same thing (code, message and hint) at several places
    merged into one, its ``where`` naming the first ``shown`` places and how many there are:
    mobilenet_v2 at batch 2 has one small-batch BatchNorm lint, not 52. In the order of each
    group's first lint."""
    groups: dict[tuple[str, str, str, str], list[Lint]] = {}
    for lint in lints:
        groups.setdefault((lint.code, lint.kind, lint.message, lint.hint), []).append(lint)
    merged = []
    for same in groups.values():
        if len(same) == 1:
            merged.append(same[0])
            continue
        places = ", ".join(lint.where for lint in same[:shown])
        more = f" and {len(same) - shown} more" if len(same) > shown else ""
        merged.append(replace(same[0], where=f"{len(same)} places: {places}{more}"))
    return merged


def _lint(code: str, kind: str, where: str, message: str, hint: str) -> Lint:
    return Lint(code, kind, where, message, hint, TIPS[code])


def _called(gm: fx.GraphModule, types: Any) -> list[tuple[fx.Node, nn.Module]]:
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, types):
                found.append((node, module))
    return found


def large_linear(gm: fx.GraphModule, example_inputs: Any = None, *, share: float = 0.5,
                 min_bytes: int = 2**20) -> list[Lint]:
    """Linear layers holding at least ``share`` of all parameter bytes and ``min_bytes``."""
    total = storage_bytes(list(gm.parameters()))
    lints = []
    for node, linear in _called(gm, nn.Linear):
        size = storage_bytes(list(linear.parameters()))
        if total and size >= share * total and size >= min_bytes:
            lints.append(_lint(
                "large-linear", "memory", node.target,
                f"Linear({linear.in_features}, {linear.out_features}) holds "
                f"{format_bytes(size)} of parameters, {size / total:.0%} of the model's; training "
                f"needs {format_bytes(2 * size)} with its gradient, {format_bytes(4 * size)} "
                "with Adam's two moments",
                "shrink it: pool or downsample before it, a smaller hidden size, or a low-rank "
                "pair nn.Linear(m, r), nn.Linear(r, n) with r << min(m, n)"))
    return lints


def batchnorm_small_batch(gm: fx.GraphModule, example_inputs: Any = None, *,
                          min_batch: int = 8) -> list[Lint]:
    """BatchNorm layers in train mode whose input batch is below ``min_batch``."""
    lints = []
    for node, bn in _called(gm, BatchNormBase):
        value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not bn.training or not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if value.shape[0] < min_batch:
            lints.append(_lint(
                "batchnorm-small-batch", "training", node.target,
                f"{type(bn).__name__} normalizes over a batch of {value.shape[0]} "
                f"(< {min_batch}): its batch statistics are noisy",
                "use a per-device batch of 8 or more, nn.SyncBatchNorm across devices, or "
                "nn.GroupNorm, which does not depend on the batch"))
    return lints


def _raw_and_final(gm: fx.GraphModule) -> tuple[set[fx.Node], set[fx.Node]]:
    """Nodes computed from the inputs without a weighted layer on the way, and weighted layers
    whose result reaches the output without another weighted layer on the way."""
    weighted = {node for node, _ in _called(gm, _WEIGHTED)}
    raw: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or (node not in weighted and node.all_input_nodes and all(
                n in raw or n.op == "get_attr" for n in node.all_input_nodes)):
            raw.add(node)
    reaches_output: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "output" or any(u in reaches_output and u not in weighted
                                      for u in node.users):
            reaches_output.add(node)
    return raw, weighted & reaches_output


def not_multiple_of_8(gm: fx.GraphModule, example_inputs: Any = None) -> list[Lint]:
    """Channels, features and the batch size that are not multiples of 8."""
    raw, final = _raw_and_final(gm)
    pad = passes.REGISTRY.lookup("pad_channels")
    hint = ("make them multiples of 8 (or of 64 for large layers)"
            + (": the pad_channels pass pads conv channels for you" if pad else ""))
    lints = []
    for node, layer in _called(gm, _WEIGHTED):
        is_linear = isinstance(layer, nn.Linear)
        sizes = ((layer.in_features, layer.out_features) if is_linear
                 else (layer.in_channels, layer.out_channels))
        data_given = (node.args and node.args[0] in raw, node in final)
        odd = [f"{size} ({side})" for size, side, given in zip(sizes, ("in", "out"), data_given)
               if size % 8 and not given]
        if odd:
            what = "features" if is_linear else "channels"
            lints.append(_lint("not-multiple-of-8", "speed", node.target,
                               f"{type(layer).__name__} {what} {', '.join(odd)} are not "
                               "multiples of 8: GPU tensor cores run below full speed", hint))
    batch = next((n.meta["val"].shape[0] for n in gm.graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()), None)
    if batch is not None and batch % 8:
        lints.append(_lint("not-multiple-of-8", "speed", "batch size",
                           f"the batch size {batch} is not a multiple of 8",
                           "use a batch size that is a multiple of 8"))
    return lints


def user_source_line(node: fx.Node) -> str:
    """The line of the user's forward that made ``node`` (from its recorded stack trace)."""
    frames = re.findall(r'File "([^"]+)", line \d+, in \S+\n\s*(.*)', node.stack_trace or "")
    user = [line for path, line in frames if is_user_file(path)]
    return user[-1] if user else ""


def _dropout_training(node: fx.Node) -> bool:
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    bound.apply_defaults()
    arguments = bound.arguments
    return bool(arguments.get("training", arguments.get("train", False)))


def train_mode_for_inference(gm: fx.GraphModule, example_inputs: Any = None, *,
                             for_inference: bool = False) -> list[Lint]:
    """Dropout/BatchNorm left in train mode for inference; functional dropout always on."""
    lints = []
    if for_inference or not gm.training:
        why = ("the model is meant for inference" if for_inference
               else "the model is in eval mode but this submodule is not")
        for node, module in _called(gm, (DropoutBase, BatchNormBase)):
            if module.training:
                lints.append(_lint(
                    "train-mode-for-inference", "correctness", node.target,
                    f"{type(module).__name__} is in train mode and {why}: "
                    + ("it drops activations at random" if isinstance(
                        module, nn.modules.dropout._DropoutNd)
                       else "it normalizes with batch statistics and updates running stats"),
                    "call model.eval() (and run under torch.no_grad()) for inference"))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _FUNCTIONAL_DROPOUT:
            continue
        if _dropout_training(node) and not _MODE_AWARE.search(user_source_line(node)):
            name = getattr(node.target, "__name__", str(node.target))
            lints.append(_lint(
                "functional-dropout-always-on", "correctness", node.name,
                f"{name}(...) is called without training=self.training, so it keeps dropping "
                f"activations after model.eval() ({user_source_line(node) or 'source line unknown'})",
                f"pass training=self.training, or use an nn.{'Dropout2d' if '2d' in name else 'Dropout'} "
                "module"))
    return lints


def run_lints(gm: fx.GraphModule, example_inputs: Any = None, *,
              for_inference: bool = False) -> list[Lint]:
    """Every lint above, in the order: memory, training, speed, correctness."""
    return [*large_linear(gm, example_inputs), *batchnorm_small_batch(gm, example_inputs),
            *not_multiple_of_8(gm, example_inputs),
            *train_mode_for_inference(gm, example_inputs, for_inference=for_inference)]
