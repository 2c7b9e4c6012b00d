"""Exact live-tensor-storage accounting with a TorchDispatchMode.

``LiveStorageTracker`` sees every aten op that runs while it is active -- forward, autograd's
backward ops (run on the calling thread on CPU), gradient accumulation -- and records each output
storage it has not seen before with its size. A storage counts as freed once its StorageImpl is
gone (``StorageWeakRef.expired()``), so frees caused by Python dropping the last reference
between ops (FX's ``x = None`` after a last use, autograd releasing saved tensors) are seen at the
next op. Checking every live storage before every op would cost O(live) per op; since frees only
lower the count, ``current_bytes`` between collections is an upper bound (it still counts frees
not collected yet), and the tracker collects only when that bound passes the peak -- the peak is
exact either way. With ``record_timeline=True``
it collects before every op, so each timeline entry is exact too. Views share their base's storage and in-place ops return
an existing storage, so neither is counted twice.

It works the same on real CPU tensors and on FakeTensors (push the FakeTensorMode first, then the
tracker): a fake storage has the size a real one would have, which is how ``fxopt.analysis``
predicts the peak of a model without running it.

On CUDA (real or fake tensors on a CUDA device) a storage counts as the block the caching
allocator hands out for it (``fxopt.core.tensors.allocated_bytes``: its size rounded up to a
multiple of 512 bytes, as ``torch.cuda.max_memory_allocated`` counts it with the allocator's
default settings); so a prediction made on a machine without a GPU, on fake CUDA tensors, is in
the allocator's units.
Workspaces that cuBLAS/cuDNN allocate outside tensors are not seen unless the tracker is given
their sizes as measured on the device (``device_memory``: each is counted as live while its op
runs, then gone). Storages resized in place (``untyped_storage().resize_()``, how FSDP2 frees and
re-allocates the gathered parameters between uses) are not seen unless the tracker is built with
``follow_resizes=True``: it then reads
each live storage's size before and after every op (O(live) per op; for measurements of small
models, e.g. FSDP2 on CPU).

Storages that existed before the tracker started (parameters, buffers, inputs) are not counted,
nor views of them: an op output that shares a storage with one of the op's inputs allocated
nothing. ``fxopt.measure`` adds the pre-existing storages as the baseline.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fxopt.core.tensors import allocated_bytes, storage_key, tensors_in
from fxopt.core.training_setup import DeviceMemory, op_signature
from fxopt.core.torch_private import StorageWeakRef, storage_expired
from fxopt.core.torch_private import TorchDispatchMode


@dataclass
class _Live:
    ref: StorageWeakRef
    nbytes: int
    tag: str | None = None
    storage: Any = None  # a weak reference to the storage object (``follow_resizes``)
    handed_back: int | None = None  # the tracker's peak count when backward took it back


_TAG: list[str | None] = [None]  # what storages allocated now are counted as (see ``tagged``)
_ACTIVE: list[LiveStorageTracker] = []


@contextlib.contextmanager
def tagged(tag: str) -> Iterator[None]:
    """Storages allocated inside are tagged ``tag`` by every tracker (``tagged_bytes_at_peak``):
    e.g. the temporaries of an optimizer step run inside backward."""
    previous, _TAG[0] = _TAG[0], tag
    try:
        yield
    finally:
        _TAG[0] = previous


def tag_live(tensors: Any, tag: str) -> None:
    """Tag the storages of ``tensors`` that active trackers count (e.g. a gradient, once
    accumulated, as a gradient): a peak they are part of, before or after, shows them under
    ``tag``."""
    for tracker in _ACTIVE:
        for t in tensors_in(tensors):
            live = tracker._live.get(storage_key(t))
            if live is not None and not live.ref.expired():
                live.tag = tag


def tag_untagged_live(tag: str) -> None:
    """Tag every storage that active trackers count as alive now and that has no tag yet: e.g.
    what a forward made and left alive, once it returns (its outputs tagged first)."""
    for tracker in _ACTIVE:
        for live in tracker._live.values():
            if live.tag is None and not live.ref.expired():
                live.tag = tag


def mark_handed_back(tensors: Any) -> None:
    """Note that backward has taken back these tensors that forward saved for it (autograd
    unpacked them): a peak active trackers note from now on holds them for something else
    (``bytes_by_tag_at_peak``'s ``lapsing`` tags)."""
    for tracker in _ACTIVE:
        for t in tensors_in(tensors):
            live = tracker._live.get(storage_key(t))
            if live is not None and not live.ref.expired():
                live.handed_back = tracker._peaks


class LiveStorageTracker(TorchDispatchMode):
    """Tracks bytes of storages created while active; ``peak_bytes`` is their maximum sum.

    ``timeline`` (with ``record_timeline=True``) lists ``(op name, live bytes)`` after each op.
    """

    def __init__(self, *, record_timeline: bool = False, follow_resizes: bool = False,
                 device_memory: DeviceMemory | None = None) -> None:
        super().__init__()
        self.device_memory = device_memory
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_op = ""
        self.record_timeline = record_timeline
        self.follow_resizes = follow_resizes
        self.timeline: list[tuple[str, int]] = []
        self._live: dict[int, _Live] = {}
        self._at_peak: dict[int, StorageWeakRef] = {}
        self._known: set[int] = set()
        self._live_at_peak: list[_Live] = []
        self._peaks = 0  # how many times the peak rose
        # What was live at the peak is written down (``_at_peak``, ``_live_at_peak``) only when
        # asked for, not each time the peak rises (in a forward nearly every op raises it):
        # until then, what was added since it rose (by object id, kept alive so no id is
        # reused) and, with their keys, what was live at it and has gone since; None once
        # written.
        self._added_since_peak: dict[int, _Live] | None = None
        self._gone_since_peak: list[tuple[int, _Live]] = []

    def ignore(self, tensors: Any) -> None:
        """Treat these tensors' storages as pre-existing (never counted)."""
        self._known.update(storage_key(t) for t in tensors_in(tensors))

    def _collect_freed(self) -> None:
        for key in [k for k, live in self._live.items() if storage_expired(live.ref.cdata)]:
            self.current_bytes -= self._pop(key).nbytes
            self._known.discard(key)
        if self.follow_resizes:
            for live in self._live.values():
                storage = live.storage() if live.storage is not None else None
                if storage is not None and storage.nbytes() != live.nbytes:
                    self.current_bytes += storage.nbytes() - live.nbytes
                    live.nbytes = storage.nbytes()
            self._note_peak("resize")

    def _add(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key in self._known and key not in self._live:
            return
        if key in self._live:
            if not self._live[key].ref.expired():
                return
            self.current_bytes -= self._pop(key).nbytes  # address reused after a free
        nbytes = allocated_bytes(t)
        storage = weakref.ref(t.untyped_storage()) if self.follow_resizes else None
        live = self._live[key] = _Live(StorageWeakRef(t.untyped_storage()), nbytes, _TAG[0],
                                       storage)
        self.current_bytes += nbytes
        if self._added_since_peak is not None:
            self._added_since_peak[id(live)] = live

    def _pop(self, key: int) -> _Live:
        live = self._live.pop(key)
        if self._added_since_peak is not None and id(live) not in self._added_since_peak:
            self._gone_since_peak.append((key, live))
        return live

    def _note_peak(self, op: str) -> None:
        if self.current_bytes > self.peak_bytes:
            self._peaks += 1
            self.peak_bytes = self.current_bytes
            self.peak_op = op
            self._added_since_peak, self._gone_since_peak = {}, []

    def _keep_peak(self) -> None:
        """Write down what was live at the peak, if not yet: what is live now and was not added
        since, and what has gone since."""
        added = self._added_since_peak
        if added is None:
            return
        at_peak = [*((key, live) for key, live in self._live.items() if id(live) not in added),
                   *self._gone_since_peak]
        self._at_peak = {key: live.ref for key, live in at_peak}
        self._live_at_peak = [live for _, live in at_peak]
        self._added_since_peak, self._gone_since_peak = None, []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.before_op()
        out = func(*args, **(kwargs or {}))
        self.after_op(func, args, kwargs, out)
        return out

    @contextlib.contextmanager
    def observing(self, mode: Any) -> Iterator[LiveStorageTracker]:
        """Inside: the tracker counts the ops ``mode`` runs, as an observer the mode calls
        around each op it is handed (``fxopt.graph.fake_run.RealSizedFakeMode.observed_by``)
        instead of a dispatch mode of its own above it: the same ops, one trip through Python
        fewer per op. ``with tracker:`` counts what any mode below it runs."""
        _ACTIVE.append(self)
        try:
            with mode.observed_by(self):
                yield self
        finally:
            _ACTIVE.remove(self)
            self._collect_freed()

    def before_op(self) -> None:
        if self.record_timeline or self.follow_resizes:
            self._collect_freed()

    def after_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        # An output sharing an input's storage (a view, an in-place result) allocated nothing.
        reused = {storage_key(t) for t in tensors_in((args, kwargs))}
        for t in tensors_in(out):
            if storage_key(t) not in reused:
                self._add(t)
        if self.current_bytes > self.peak_bytes:  # an upper bound until collected: make it exact
            self._collect_freed()  # once per op, after all its outputs: the op's peak is then
            self._note_peak(name)  # the same as after its last output, for one scan, not one each
        elif self.record_timeline or self.follow_resizes:
            self._collect_freed()
        if self.device_memory is not None:
            self._note_workspace(func, args, kwargs, name)
        if self.record_timeline:
            self.timeline.append((name, self.current_bytes))

    def _note_workspace(self, func: Any, args: Any, kwargs: Any, name: str) -> None:
        """A workspace the device's kernel for this op holds while it runs (measured,
        ``fxopt.core.training_setup.DeviceMemory``): a peak of its own, never live after it."""
        workspace = self.device_memory.workspace(op_signature(func, args, kwargs))
        if workspace and self.current_bytes + workspace > self.peak_bytes:
            self._collect_freed()
            self.current_bytes += workspace
            self._note_peak(f"{name} (workspace)")
            self.current_bytes -= workspace

    @property
    def tagged_bytes_at_peak(self) -> dict[str, int]:
        """Tag -> bytes of the storages with that tag (``tagged``, ``tag_live``) at the peak."""
        return self.bytes_by_tag_at_peak()

    def bytes_by_tag_at_peak(self, lapsing: tuple[str, ...] = ()) -> dict[str, int]:
        """Tag -> bytes of the storages with that tag at the peak; a storage whose tag is one of
        ``lapsing`` and that backward took back before the peak (``mark_handed_back``) counts
        as untagged: e.g. a saved tensor of forward that backward turned into a gradient."""
        self._keep_peak()
        found: dict[str, int] = {}
        for live in self._live_at_peak:
            tag = live.tag
            if tag in lapsing and live.handed_back is not None and live.handed_back < self._peaks:
                tag = None
            if tag is not None:
                found[tag] = found.get(tag, 0) + live.nbytes
        return found

    def __enter__(self) -> LiveStorageTracker:
        _ACTIVE.append(self)
        return super().__enter__()

    def bytes_at_peak(self, tensors: Any) -> int:
        """Of the storages live at the peak, the bytes of those belonging to ``tensors``.

        Keys are addresses: a storage at the address of one freed since the peak (common with
        fake tensors) is another storage, so only peak storages still alive are matched."""
        self._keep_peak()
        seen, total = set(), 0
        for t in tensors_in(tensors):
            key = storage_key(t)
            at_peak = self._at_peak.get(key)
            if at_peak is not None and not at_peak.expired() and key not in seen:
                seen.add(key)
                total += self._live[key].nbytes if key in self._live else allocated_bytes(t)
        return total

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        _ACTIVE.remove(self)
        self._collect_freed()
        return result
