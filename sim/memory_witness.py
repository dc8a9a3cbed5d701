"""A second instrument for the tracker, on CPU: the allocator's own count of a step, from torch.profiler.

On CUDA the trainer's peak is the caching allocator's; on CPU it is `sim.memory.MemoryTracker`'s,
the very instrument the planner simulates with, so "planned as trained" there compares one
instrument with itself. This module asks another one. PyTorch's CPU allocator reports each
allocation and free to a reporter (c10's ProfiledCPUMemoryReporter: the bytes asked for, not
rounded), and with `profile_memory=True` the profiler records each report as a `[memory]`
event carrying the bytes allocated (or freed), the address, and the reporter's running total.
The peak of that total above its value at a step's start is the allocator's peak for the step,
to set beside the tracker's peak above its own baseline (`AllocatorWitness.measure`).

Only the threads the profiler follows report: the one that entered it, autograd's, and a gloo
worker while it runs a collective (torch carries the profiler's thread state into the work).
A gloo worker drops a finished collective's tensors after that, and when its reference was the
last, the free went unreported and was never subtracted: a block gradient of 793,088 B then
stayed "live" to the end of a step (in 5 runs of 6 of tests/test_memory_witness.py, some
stage). So the witness turns on c10's `caffe2_report_cpu_memory_usage` flag, under which
the reporter keeps its table and total in every thread. Each recorded event then carries the true total, whichever thread freed what
since; the flag stays on for the rest of the process (a few microseconds per CPU allocation),
so that the table stays exact from one witness to the next. The reporter knows only blocks
allocated since the flag went on: one allocated before and freed later is never subtracted,
so what a measured step frees must have been allocated under a witness (build and warm up
inside it). Single events are kept for attribution (`temporaries`); the peak
and the end come from the totals.

What the allocator counts that the tracker does not is named and measured in docs/MEMORY.md;
tests/test_memory_witness.py bounds the difference by those quantities.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile, record_function

T = TypeVar("T")

_PROBE = 1  # bytes of the allocation that marks each end of a window in the allocator's own events


def report_in_every_thread() -> None:
    """Turn on c10's FLAGS_caffe2_report_cpu_memory_usage (a plain global of libc10 in builds
    without gflags, as PyTorch's wheels are): the CPU allocator's reporter then counts in every
    thread, not only where a profiler listens. Its INFO log lines are below the default level."""
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(libs[0]), "FLAGS_caffe2_report_cpu_memory_usage")
    except (IndexError, OSError, ValueError) as e:
        raise RuntimeError("cannot reach c10's caffe2_report_cpu_memory_usage flag in this torch build: without "
                           "it, frees in gloo's worker threads would go uncounted") from e
    flag.value = True


@dataclass(frozen=True)
class Allocation:
    """One allocator event: `nbytes` > 0 allocated, < 0 freed, at `ns`, inside `ops` (outermost
    first), on profiler thread `tid`; `total` is the reporter's count of live bytes after it.
    `op` identifies the one call of the op it happened in (see `owning_op`), None outside any."""

    ns: int
    nbytes: int
    total: int
    ptr: int
    ops: tuple[str, ...]
    tid: int
    op: Optional[int] = None


def owning_op(names: list[str]) -> Optional[int]:
    """Which frame of a profiler path (outermost first) is the op an event belongs to: the one a
    TorchDispatchMode intercepted (the frame after the innermost "PythonDispatchMode", which is
    what a MemoryTracker sees as one op), else the outermost aten op; None outside any op."""
    if "PythonDispatchMode" in names:
        i = len(names) - names[::-1].index("PythonDispatchMode")
        return i if i < len(names) else None
    return next((i for i, n in enumerate(names) if n.startswith("aten::")), None)


@dataclass(frozen=True)
class Window:
    """The allocator's events of one window, in time order, and its live bytes when the window opened
    (`base`) and closed (`last`), read by a probe allocation at each end."""

    label: str
    events: tuple[Allocation, ...]
    base: int
    last: int

    @property
    def peak(self) -> int:
        """The most bytes live above the start after any event of the window (0 if never above)."""
        return max([self.base, *(e.total for e in self.events)]) - self.base

    @property
    def end(self) -> int:
        """Live bytes at the end, above the start."""
        return self.last - self.base

    def temporaries(self) -> dict[str, int]:
        """For each op, the most bytes that one call of it held live of what it allocated and freed
        again before returning: the workspace of a kernel, invisible to a TorchDispatchMode, which
        sees only what an op returns."""
        calls: dict[int, list[Allocation]] = {}
        for e in self.events:
            if e.op is not None:
                calls.setdefault(e.op, []).append(e)
        most: dict[str, int] = {}
        for events in calls.values():
            # an address is reused: pair each free with the allocation at its address just before it
            open_at: dict[int, int] = {}
            paired: set[int] = set()  # indices of both events of each pair
            for i, e in enumerate(events):
                if e.nbytes > 0:
                    open_at[e.ptr] = i
                elif e.ptr in open_at:
                    paired |= {open_at.pop(e.ptr), i}
            live = peak = 0
            for i in sorted(paired):
                live += events[i].nbytes
                peak = max(peak, live)
            name = events[0].ops[owning_op(list(events[0].ops))]
            most[name] = max(most.get(name, 0), peak)
        return {k: v for k, v in sorted(most.items(), key=lambda kv: -kv[1]) if v}

@dataclass(frozen=True)
class StepMemory:
    """One step's peak and net change above its start, by the allocator and by the tracker (bytes),
    and what the tracker counted live at the start (its baseline)."""

    allocator_peak: int
    tracker_peak: int
    allocator_end: int
    tracker_end: int
    tracker_base: int
    window: Window


class AllocatorWitness:
    """Profile the CPU allocator while entered; `window(label)` marks a span to measure, and
    `measure(label, step, tracker)` runs a step in one beside a tracker.

        with AllocatorWitness() as w:
            engine = build()                 # what a step frees must be allocated from here on
            step()                           # warm-up: the previous step's leftovers, too
            w.measure("step", step, tracker)
        w.steps["step"].allocator_peak, w.steps["step"].tracker_peak

    The reporter's count is exact for blocks allocated since the first witness was entered: one
    allocated before and freed in a window is never subtracted (the reporter never learnt its size).
    """

    def __init__(self) -> None:
        self.windows: dict[str, Window] = {}
        self.steps: dict[str, StepMemory] = {}
        self._labels: list[str] = []
        self._tracked: dict[str, tuple[int, int, int]] = {}
        self._prof: Optional[profile] = None

    def __enter__(self) -> "AllocatorWitness":
        report_in_every_thread()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._prof is not None
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._read(self._prof.profiler.kineto_results.experimental_event_tree())

    @contextlib.contextmanager
    def window(self, label: str) -> Iterator[None]:
        if label in self._labels:
            raise ValueError(f"window {label!r} twice")
        self._labels.append(label)
        with record_function(f"memory_witness:{label}:open"):
            torch.empty(_PROBE, dtype=torch.uint8)
        try:
            yield
        finally:
            with record_function(f"memory_witness:{label}:close"):
                torch.empty(_PROBE, dtype=torch.uint8)

    def measure(self, label: str, step: Callable[[], T], tracker) -> T:
        """Run `step` in window `label` with `tracker` (a sim.memory.MemoryTracker) reset and entered.

        The tracker's peak is `tracker.peak` after `reset_peak()`, less the live bytes at the
        reset: how the trainer reads it (train/loop.py), less its baseline. It is the device's
        peak; the allocator's is every CPU allocation, so an offloaded optimizer's host memory
        would be in one and not the other.
        """
        gc.collect()  # what earlier work left to the collector is not freed inside the window
        tracker.reset_peak()
        base = sum(tracker.live.values())
        with self.window(label):
            with tracker:
                out = step()
            self._tracked[label] = (tracker.peak - base, sum(tracker.live.values()) - base, base)
        return out

    def _read(self, roots) -> None:
        probes: dict[str, int] = {}  # "label:open" -> the reporter's count after the probe's allocation
        spans: dict[str, int] = {}
        events: list[Allocation] = []

        def walk(node, path: list) -> None:
            if node.name == "[memory]":
                f, names = node.extra_fields, [n.name for n in path]
                probe = next((n.removeprefix("memory_witness:") for n in names if n.startswith("memory_witness:")),
                             None)
                if probe is not None:
                    if f.alloc_size > 0:
                        probes[probe], spans[probe] = f.total_allocated, node.start_time_ns
                    return
                at = owning_op(names)
                events.append(Allocation(node.start_time_ns, f.alloc_size, f.total_allocated, f.ptr, tuple(names),
                                         node.start_tid, None if at is None else path[at].id))
                return
            for child in node.children:
                walk(child, path + [node])

        for root in roots:
            walk(root, [])
        events.sort(key=lambda e: e.ns)  # stable: events of one instant keep the profiler's order
        for label in self._labels:
            lo, hi = spans[f"{label}:open"], spans[f"{label}:close"]
            window = Window(label, tuple(e for e in events if lo < e.ns < hi),
                            probes[f"{label}:open"] - _PROBE, probes[f"{label}:close"] - _PROBE)
            self.windows[label] = window
            if label in self._tracked:
                peak, end, base = self._tracked[label]
                self.steps[label] = StepMemory(window.peak, peak, window.end, end, base, window)
