"""Every key fxopt reads or writes in ``node.meta`` and ``gm.meta``: the contracts between layers.

A layer that writes one of these and a layer that reads it agree here, by name and by what the
value holds; code uses the constants, never the strings.

``gm.meta`` (a captured GraphModule):

- ``TRACE`` (``"fxopt_trace"``): a ``fxopt.capture.trace.TraceInfo``: which frontend captured
  the model, the opaque leaves and why, why the other frontends were not used. Written by
  capture, read by the report, the leaf runs and the CLI.
- ``EXPORT`` (``"fxopt_export"``): a ``fxopt.capture.export_frontend.ExportInfo`` on a module
  torch.export captured: which input sizes stayed dynamic.
- ``CAPTURED`` (``"fxopt_captured"``): a ``fxopt.capture.reuse.CapturedFrom`` on what
  ``fxopt.capture_model`` returns: the model and inputs it was made of, checked when
  ``optimize(captured=...)`` reuses it; removed from the copy optimize works on.
- ``BLOCKS`` (``"fxopt_blocks"``): what ``fxopt.rewrite.blocks`` kept as block calls, and the
  blocks left flat with why.
- ``INLINED`` (``"fxopt_inlined"``): on what ``fxopt.optimize`` returns, the path, class name
  (``"module.qualname"``), constants (``fxopt.core.modules.constant_values``) and whether its
  mode changes what it computes (the capture's ``TraceInfo.mode_dependent_modules``) of every
  module its graphs run inline (call none of), as optimize left them; and ``CHECKED``
  (``"fxopt_checked"``): per training mode and grad mode, the modules the call guard last found
  consistent with them, as they were (emptied on a deep copy, left out of a pickle). Both
  written and read by ``fxopt.integrations.call_guard``.
- ``BLOCK_CONSTANTS`` (``"fxopt_block_constants"``): on a block ``fxopt.rewrite.blocks`` kept,
  and on the optimized module itself, ``{name: value}`` of the scalar attributes of the module
  it stands for (the user's root, for the optimized module)
  (``fxopt.core.modules.constant_values``), which the block holds too and its graph has built
  in; read by ``constant_values`` and the call guard.

``node.meta``:

- ``PASS`` (``"fxopt_pass"``): the name of the pass that created the node (provenance;
  ``fxopt.rewrite.pass_base.mark_new`` writes it, the invariants check it on every new node).
- ``SAVED`` (``"fxopt_saved"``): a ``fxopt.analysis.saved.SavedInfo``: what autograd saves for
  the node's backward (written by ``saved_for_backward``).
- ``META_SOURCE`` (``"fxopt_meta_source"``): ``"real"`` when the node's ``meta["val"]`` came
  from a real run (an opaque leaf that cannot run on fake tensors); absent for fake runs.
- ``LEAF`` (``"fxopt_leaf"``): an opaque leaf's recorded real run(s)
  (``fxopt.graph.leaf_tape``).
- ``NN_MODULE_STACK`` (``"nn_module_stack"``, torch's own): the modules the node runs in,
  ``{key: (path, kind)}`` outermost first, ``kind`` a class (symbolic tracing) or its qualified
  name (torch.export). Read it with ``module_stack(node)``.
"""

from __future__ import annotations

from typing import Any

from torch import fx

TRACE = "fxopt_trace"
EXPORT = "fxopt_export"
CAPTURED = "fxopt_captured"
BLOCKS = "fxopt_blocks"
INLINED = "fxopt_inlined"
CHECKED = "fxopt_checked"
BLOCK_CONSTANTS = "fxopt_block_constants"
PASS = "fxopt_pass"
SAVED = "fxopt_saved"
META_SOURCE = "fxopt_meta_source"
LEAF = "fxopt_leaf"
NN_MODULE_STACK = "nn_module_stack"

REAL = "real"  # META_SOURCE's value for metadata from a real run


def module_stack(node: fx.Node) -> list[tuple[str, Any]]:
    """``(path, kind)`` of each module ``node`` runs in, outermost first ([] when unrecorded:
    nodes a pass made, placeholders); ``kind`` is a class or a qualified class name."""
    stack = node.meta.get(NN_MODULE_STACK) or {}
    return [(str(path), kind) for path, kind in stack.values()]


def kind_name(kind: Any) -> str:
    """A module stack entry's class name (``Linear``), from a class or a qualified name."""
    return getattr(kind, "__name__", str(kind).rpartition(".")[2])
