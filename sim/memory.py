"""Live tensor bytes by category, with a timeline and a peak, on meta and real tensors alike.

`MemoryTracker` is a `TorchDispatchMode`. While it is entered, every storage an op
creates is counted under the current category and uncounted when the storage dies
(a weak reference to the storage object, which PyTorch keeps alive exactly as long as
the storage). Storage that exists before, or is allocated outside any op, is registered
with `track`. A storage resized in place (`untyped_storage().resize_`, beneath the
dispatcher) is re-measured with `resized`. On the meta device nothing is allocated,
but storages still have sizes, so a simulated step is counted exactly like a real one.

Host memory (ZeRO-Offload's optimizer state) is counted apart from device memory:
what is allocated while `sim.placement` says the work is on the host, or registered
with `track(..., host=True)`. The peak is the device's; the host has its own.

It counts tensor bytes, not allocator blocks: no caching-allocator rounding or
fragmentation. What a kernel allocates beyond its outputs, it counts where that is known
(sim.kernel_memory): an op's temporaries while it runs, and, given a device's
`workspaces`, the matmul workspaces its threads keep.

Looking changes one thing it looks at. A storage's Python object, once made, holds a
reference to the storage for as long as it lives, so autograd never finds that it holds
the last reference to a gradient and never adds the next gradient into it in place (its
InputBuffer): it allocates the sum. Where one tensor gets two large gradients, a run
without the tracker peaks lower than tracked (the planner errs high). zerofunc's models
avoid the one large case, a tied embedding's (zerofunc/lm_head.py); a residual stream's
is one activation-sized tensor.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sim import placement
from sim.kernel_memory import MatmulWorkspaces, ThreadWorkspaces, temporary_bytes
from sim.tensors import tensors

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "other")
# set_ points a tensor at a storage someone else made, and allocates nothing: safetensors makes its
# tensors this way over the file's memory map, which is page cache, not the process's own memory
_ADOPTING = {torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset}


class Timeline(Sequence):
    """A report's timeline, (label, device bytes live per CATEGORIES, host bytes live) per sample, made into
    Python tuples only when read: a simulated step samples tens of thousands of times, and the planner's
    searches need only each sample's device total (`totals`)."""

    def __init__(self, labels: list[str], device: np.ndarray, host_totals: np.ndarray):
        self._labels, self._device, self._host = labels, device, host_totals

    @functools.cached_property
    def totals(self) -> np.ndarray:
        """The device bytes live at each sample."""
        return self._device.sum(axis=1)

    @functools.cached_property
    def _rows(self) -> list[tuple[str, tuple[int, ...], int]]:
        return list(zip(self._labels, map(tuple, self._device.tolist()), self._host.tolist()))

    def __getitem__(self, i):
        return self._rows[i]

    def __len__(self) -> int:
        return len(self._labels)

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented


@dataclass
class MemoryReport:
    """What a tracker saw: per category its largest live value, and the peak of the total, on the
    device; and the same for host memory."""

    max_by_category: dict[str, int]
    peak: int
    at_peak: dict[str, int]
    # (label, device bytes live per CATEGORIES, host bytes live): a list, or a Timeline
    timeline: Sequence[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    host_max_by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    host_peak: int = 0

    @property
    def model_states(self) -> int:
        return sum(self.max_by_category[c] for c in ("params", "grads", "optimizer"))


def report_of(labels: list[str], live: np.ndarray, timeline: bool = False) -> MemoryReport:
    """The report a tracker (keep_samples) gives, from its samples alone: `live` has a row per sample, device
    then host bytes per category. Each category's largest live value and the total's peak (the first moment
    it is reached), from nothing live, on the device and the host."""
    n = len(CATEGORIES)
    if len(live) == 0:
        live = np.zeros((1, 2 * n), dtype=np.int64)
    device, host = live[:, :n], live[:, n:]
    totals, host_totals = device.sum(axis=1), host.sum(axis=1)
    first = int(np.argmax(totals))
    at_peak = device[first].tolist() if totals[first] > 0 else [0] * n
    return MemoryReport(dict(zip(CATEGORIES, np.maximum(device.max(axis=0), 0).tolist())), max(int(totals[first]), 0),
                        dict(zip(CATEGORIES, at_peak)),
                        Timeline(labels, device, host_totals) if timeline else [],
                        dict(zip(CATEGORIES, np.maximum(host.max(axis=0), 0).tolist())), max(int(host_totals.max()), 0))


class MemoryTracker(TorchDispatchMode):
    def __init__(self, keep_timeline: bool = False, workspaces: MatmulWorkspaces = MatmulWorkspaces(),
                 keep_samples: bool = False):
        super().__init__()
        self.workspaces = ThreadWorkspaces(workspaces)
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.max = dict.fromkeys(CATEGORIES, 0)
        self.peak = 0
        self.at_peak = dict(self.live)
        self.host_live = dict.fromkeys(CATEGORIES, 0)
        self.host_max = dict.fromkeys(CATEGORIES, 0)
        self.host_peak = 0
        self.keep_timeline = keep_timeline
        self.timeline: list[tuple[str, tuple[int, ...], int]] = []
        # every change in full: its label, and device then host live bytes per category (report_of reads them,
        # zerofunc.plan.folding extends them)
        self.keep_samples = keep_samples
        self.sample_labels: list[str] = []
        self.samples: list[tuple[int, ...]] = []
        self._label = ""
        self._category = ["other"]
        self._storages: dict[int, list] = {}  # id(storage) -> [category, nbytes, weakref, host]
        self._in_backend = 0                  # > 0 inside a collective call: its allocations are the backend's
        self._held = itertools.count(-1, -1)  # keys of hold()s, never an id() of a storage

    # ---- categories and registration --------------------------------------------------
    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        """Count storages created inside the block under `name`."""
        if name not in CATEGORIES:
            raise ValueError(f"unknown memory category {name!r}")
        self._category.append(name)
        try:
            yield
        finally:
            self._category.pop()

    @contextlib.contextmanager
    def backend(self) -> Iterator[None]:
        """Do not count what is allocated inside the block: a collective backend's own staging.

        What a backend stages is not always visible here (gloo copies a reduce-scatter's
        input in the calling thread when the call blocks, in its worker thread when it
        does not) and it is freed when the worker drops the finished work, a moment after
        the caller moved on. So the communicator declares it instead, with hold() and
        drop(), from launch until the collective is waited on, as a simulation does.
        """
        self._in_backend += 1
        try:
            yield
        finally:
            self._in_backend -= 1

    def hold(self, nbytes: int, category: str = "buffers") -> int:
        """Count `nbytes` that no tensor here owns (a backend's staging) until drop(key)."""
        key = next(self._held)
        self._storages[key] = [category, nbytes, None, False]
        self.live[category] += nbytes
        self._changed(category, False)
        return key

    def drop(self, key: int) -> None:
        self._free(key)

    def mark(self, label: str) -> None:
        """Label the timeline from here on (e.g. "forward", "backward", "step")."""
        self._label = label
        self._sample()

    def track(self, tensor: torch.Tensor, category: str, host: bool = False) -> None:
        """Count `tensor`'s storage under `category` (of host memory if `host`), moving it there if
        already counted."""
        storage = tensor.untyped_storage()
        entry = self._storages.get(id(storage))
        if entry is None:
            self._add(storage, category, host)
        elif entry[0] != category or entry[3] != host:
            self._change(entry, category, entry[1], host)

    def resized(self, tensor: torch.Tensor) -> None:
        """Re-measure `tensor`'s storage after an in-place resize."""
        storage = tensor.untyped_storage()
        entry = self._storages.get(id(storage))
        if entry is not None:
            self._change(entry, entry[0], storage.nbytes(), entry[3])

    def report(self) -> MemoryReport:
        return MemoryReport(dict(self.max), self.peak, dict(self.at_peak), list(self.timeline),
                            dict(self.host_max), self.host_peak)

    def reset_peak(self) -> None:
        """Start a new measurement window from what is live now (e.g. at each training step)."""
        self.max = dict(self.live)
        self.peak = sum(self.live.values())
        self.at_peak = dict(self.live)
        self.host_max = dict(self.host_live)
        self.host_peak = sum(self.host_live.values())
        self.timeline.clear()

    # ---- the dispatch hook -------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for nbytes in self.workspaces.new(func, args):  # kept for good, as the process keeps them
            self.hold(nbytes, "other")
        temporary = temporary_bytes(func, args)  # held until the outputs are counted: the kernel has both at once
        key = self.hold(temporary, self._category[-1]) if temporary else None
        try:
            out = func(*args, **(kwargs or {}))
            host = placement.on_host(placement.where())
            for t in tensors(out):
                if not self._in_backend and id(t.untyped_storage()) not in self._storages:
                    self._add(t.untyped_storage(), self._category[-1], host, adopted=func in _ADOPTING)
        finally:
            if key is not None:
                self.drop(key)
        return out

    # ---- bookkeeping ---------------------------------------------------------------------
    def _add(self, storage, category: str, host: bool = False, adopted: bool = False) -> None:
        """Count `storage`; an adopted one is known at 0 bytes, so that its views are not counted either."""
        key = id(storage)
        # a weak reference whose callback uncounts the storage (cheaper than weakref.finalize,
        # and a simulated step of a large model makes tens of thousands); the entry keeps it alive
        nbytes = 0 if adopted else storage.nbytes()
        entry = [category, nbytes, weakref.ref(storage, lambda _, key=key: self._free(key)), host]
        self._storages[key] = entry
        (self.host_live if host else self.live)[category] += entry[1]
        self._changed(category, host)

    def _free(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            (self.host_live if entry[3] else self.live)[entry[0]] -= entry[1]
            self._changed(None, entry[3])

    def _change(self, entry: list, category: str, nbytes: int, host: bool) -> None:
        (self.host_live if entry[3] else self.live)[entry[0]] -= entry[1]
        entry[0], entry[1], entry[3] = category, nbytes, host
        (self.host_live if host else self.live)[category] += nbytes
        self._changed(category, host)

    def _changed(self, grown: Optional[str], host: bool) -> None:
        """Bookkeeping after the live bytes of category `grown` (device or host) rose (None: only fell)."""
        if grown is not None:
            live, most = (self.host_live, self.host_max) if host else (self.live, self.max)
            if live[grown] > most[grown]:
                most[grown] = live[grown]
            total = sum(live.values())
            if host:
                self.host_peak = max(self.host_peak, total)
            elif total > self.peak:
                self.peak, self.at_peak = total, dict(live)
        self._sample()

    def _sample(self) -> None:
        if self.keep_timeline:  # live's keys are CATEGORIES, in order
            self.timeline.append((self._label, tuple(self.live.values()), sum(self.host_live.values())))
        if self.keep_samples:
            self.sample_labels.append(self._label)
            self.samples.append((*self.live.values(), *self.host_live.values()))


class NoMemoryTracking:
    """Stands in for a tracker when nothing is measured: every call does nothing."""

    def category(self, name: str):
        return contextlib.nullcontext()

    def backend(self):
        return contextlib.nullcontext()

    def hold(self, nbytes: int, category: str = "buffers") -> None:
        return None

    def drop(self, key) -> None:
        pass

    def mark(self, label: str) -> None:
        pass

    def track(self, tensor: torch.Tensor, category: str, host: bool = False) -> None:
        pass

    def resized(self, tensor: torch.Tensor) -> None:
        pass
