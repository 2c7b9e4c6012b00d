"""One capture, several ``optimize`` calls: ``capture_model`` and ``reused_capture``.

Capture is most of what ``optimize`` costs on a Hugging Face model (three torch.export traces:
train mode, eval mode, a batch of one), and a budget sweep captures the same model each time.
``fxopt.capture_model(model, inputs)`` captures once; ``fxopt.optimize(model, inputs,
captured=gm)`` then starts from a copy of that capture instead of capturing again.

The capture records what it was made of (``CapturedFrom``): the model (a weak reference), the
capture options, and the model's ``fxopt.core.fingerprint`` on the example inputs. Before any
compute, ``reused_capture`` refuses, with a ``ConfigError`` that says to capture again:

- what ``capture_model`` did not return;
- a capture of another model (a copy of it included: its Parameters are other objects);
- a model changed since: a Parameter or buffer replaced, a submodule added or swapped, an
  attribute set (a Dropout's ``p``, a config field), a hook, ``requires_grad`` or a training
  flag changed, the model moved to another device or dtype;
- example inputs of another shape, dtype or device, or other plain values;
- other ``capture`` or ``leaf_modules`` options than the capture's, or ``dynamic=False`` for a
  capture with dynamic sizes;
- a capture with opaque leaves that read tensor values: their real runs were recorded on the
  model's values at capture time, which training changes (``fxopt.graph.leaf_tape``).

Each reuse works on a ``structural_copy`` of the capture (the user's Parameters shared, the graphs
copied, the eval-mode graph too: a structural copy alone shares it), so the capture is never
edited and serves any number of calls; ``optimize`` verifies the result against the model
itself, as always.

A capture does not pickle: ``torch.save`` of it raises ``ExportError`` (it names its model object,
which a file cannot); save the model's ``state_dict()`` and capture again after loading.

Not detected: a change of code behind a name (a method monkeypatched onto the model's class) and
global state a forward reads. Verification (on by default) then fails, naming the tensor that
differs.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from fxopt.capture.chain import capture as capture_chain
from fxopt.core import meta_keys
from fxopt.core.errors import ConfigError, ExportError
from fxopt.core.fingerprint import TooLarge, described
from fxopt.core.inputs import check_inputs
from fxopt.core.modules import structural_copy
from fxopt.core.state import preserved_state
from fxopt.graph.train_eval import eval_graph, replace_eval_graph
from fxopt.runtime.input_guard import captured_static

_AGAIN = "capture it again with fxopt.capture_model(model, inputs), or leave captured= out"


@dataclass(frozen=True)
class CapturedFrom:
    """What a capture was made of: ``gm.meta[meta_keys.CAPTURED]`` of ``capture_model``'s
    result. ``pinned``: the objects the fingerprint names by their address, kept alive with it."""

    model: weakref.ref
    model_name: str
    fingerprint: Hashable
    pinned: tuple[Any, ...]
    capture: str
    leaf_modules: tuple[str, ...]

    def __reduce__(self) -> Any:
        raise ExportError(
            f"a capture made by fxopt.capture_model belongs to the {self.model_name} object it "
            "was captured from, which a saved capture cannot name", where="torch.save / pickle",
            hint="save the model's state_dict() and capture again after loading it, or save "
                 "an optimized module: fxopt.export.export(optimize(...), 'out_dir')")

    def __deepcopy__(self, memo: dict) -> CapturedFrom:
        """A copy naming the same model (what pickling would do, were it allowed)."""
        return type(self)(**{f.name: copy.deepcopy(getattr(self, f.name), memo)
                             for f in dataclasses.fields(self)})


def capture_model(model: nn.Module, example_inputs: Any = (), *,
                  example_kwargs: dict[str, Any] | None = None, capture: str = "auto",
                  leaf_modules: tuple[str, ...] = (), dynamic: bool = True) -> fx.GraphModule:
    """``model`` captured as ``optimize`` captures it (``fxopt.capture.chain``), for
    ``optimize(model, example_inputs, captured=...)`` to start from, any number of times
    (module docstring). The model is left as it was."""
    args = check_inputs(model, example_inputs, example_kwargs)
    with preserved_state(model):
        gm = capture_chain(model, args, capture=capture, leaf_modules=leaf_modules,
                           dynamic=dynamic)
    try:
        fingerprint, pinned = described(model, args)
    except TooLarge:
        fingerprint, pinned = None, []
    gm.meta[meta_keys.CAPTURED] = CapturedFrom(weakref.ref(model), type(model).__name__,
                                               fingerprint, tuple(pinned), capture,
                                               tuple(leaf_modules))
    return gm


def _taped_leaves(captured: fx.GraphModule) -> list[str]:
    return [str(n.target) if n.op == "call_module" else n.name
            for n in captured.graph.nodes if meta_keys.LEAF in n.meta]


def _exported(captured: fx.GraphModule) -> bool:
    """Whether torch.export made the capture (symbolic tracing records no sizes, so its
    captures serve ``dynamic=False`` as well)."""
    return getattr(captured.meta.get(meta_keys.TRACE), "frontend", None) == "export"


def reusable(captured: fx.GraphModule) -> bool:
    """Whether ``captured`` (``capture_model``'s) can serve ``optimize(captured=...)`` while its
    model stays as it is: not when opaque leaves recorded real runs on the model's values."""
    return not _taped_leaves(captured)


def editable_copy(captured: fx.GraphModule) -> fx.GraphModule:
    """A copy of a captured module that passes may edit, the capture left as it is: a
    ``structural_copy`` (the model's Parameters shared, the graphs copied) with an eval-mode
    graph of its own. A structural copy shares the eval-mode graph (it lives in the mode
    dispatch) and keep_blocks edits that graph in place."""
    gm = structural_copy(captured)
    for module in gm.modules():
        graph = eval_graph(module) if isinstance(module, fx.GraphModule) else None
        if graph is not None:
            replace_eval_graph(module, copy.deepcopy(graph))
    return gm


def reused_capture(captured: Any, model: nn.Module, args: tuple, *, capture: str,
                   leaf_modules: tuple[str, ...], dynamic: bool = True) -> fx.GraphModule:
    """A copy of ``captured`` to optimize ``model`` on ``args`` from, or a ``ConfigError`` when
    it is not a capture of this model, unchanged, on inputs like these (module docstring)."""
    where = "optimize(captured=...)"
    record = (captured.meta.get(meta_keys.CAPTURED)
              if isinstance(captured, fx.GraphModule) else None)
    if not isinstance(record, CapturedFrom):
        raise ConfigError(f"captured= takes what fxopt.capture_model returned, got "
                          f"{type(captured).__name__}", where=where, hint=_AGAIN)
    name = type(model).__name__
    if record.model() is not model:
        raise ConfigError(f"captured= is a capture of another {record.model_name} object, not "
                          f"of the {name} given: its Parameters are not this model's",
                          where=where, hint=_AGAIN)
    if capture not in ("auto", record.capture) or (
            leaf_modules and tuple(leaf_modules) != record.leaf_modules) or (
            not dynamic and _exported(captured) and not captured_static(captured)):
        raise ConfigError(
            f"capture={capture!r}, leaf_modules={tuple(leaf_modules)}, dynamic={dynamic} differ "
            f"from the capture's (capture={record.capture!r}, leaf_modules="
            f"{record.leaf_modules}, dynamic={not captured_static(captured)})", where=where,
            hint="pass the capture options to fxopt.capture_model, not to optimize")
    taped = _taped_leaves(captured)
    if taped:
        raise ConfigError(
            f"the capture of {name} keeps opaque leaves ({', '.join(taped)}) whose real runs "
            "were recorded on the model's values at capture time", where=where,
            hint="leave captured= out: optimize captures the model as it is now")
    changed = _changed(captured, model, args, record)
    if changed:
        raise ConfigError(f"{name} changed since it was captured: {changed}", where=where,
                          hint=_AGAIN)
    gm = editable_copy(captured)
    del gm.meta[meta_keys.CAPTURED]
    gm.meta[meta_keys.TRACE] = dataclasses.replace(captured.meta[meta_keys.TRACE], reused=True)
    return gm


def _changed(captured: fx.GraphModule, model: nn.Module, args: tuple,
             record: CapturedFrom) -> str | None:
    """What differs between the model and inputs the capture was made of and these, or None."""
    for kind, theirs, ours in (
            ("Parameter", captured.named_parameters(remove_duplicate=False),
             model.named_parameters(remove_duplicate=False)),
            ("buffer", captured.named_buffers(remove_duplicate=False),
             model.named_buffers(remove_duplicate=False))):
        theirs, ours = dict(theirs), dict(ours)
        for path in sorted(theirs.keys() | ours.keys()):
            if theirs.get(path) is not ours.get(path):
                how = ("is another object" if path in theirs and path in ours
                       else "was added" if path in ours else "is gone")
                return f"{kind} {path} {how}"
    if record.fingerprint is None:
        return "it is too large to compare with its capture"
    try:
        fingerprint, _ = described(model, args)
    except TooLarge:
        return "it is too large to compare with its capture"
    if fingerprint != record.fingerprint:
        return ("a submodule, an attribute, a hook, a flag, a device or dtype, or the example "
                "inputs' shapes, dtypes or devices are not those captured")
    return None
