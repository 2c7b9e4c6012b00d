"""Global state a graph changes for a part of its run, restored however that part ends.

torch.export records ``with torch.no_grad():`` inside a model as
``wrap_with_set_grad_enabled(False, body, *args)``, whose eager implementation sets grad mode,
calls ``body`` and restores grad mode only when ``body`` returns: an error inside it (an
out-of-memory error a batch-size loop catches and retries) leaves autograd disabled for the whole
process. fxopt's captured graphs call ``grad_mode_scope`` instead, which restores it as eager
PyTorch does. ``autocast_scope`` is the same for ``wrap_with_autocast`` (whose eager form is
already a ``with`` block), so both state changes a graph can make have one exception-safe home.
Both are plain ``with`` blocks, which torch.compile traces through.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def grad_mode_scope(enable: bool, body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)`` with grad mode ``enable``; the caller's grad mode after, error or not."""
    with torch.set_grad_enabled(enable):
        return body(*args)


def autocast_scope(device_type: str, dtype: torch.dtype | None, enabled: bool,
                   cache_enabled: bool | None, body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)`` under ``torch.autocast(...)``; the caller's autocast state after."""
    with torch.autocast(device_type, dtype, enabled, cache_enabled):
        return body(*args)
