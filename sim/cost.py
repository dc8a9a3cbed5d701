"""Communication time from a ledger, with the ring alpha-beta model or measured times.

n ranks, S bytes of payload, link latency alpha and bus bandwidth B:
  all-reduce                     2(n-1) alpha + 2(n-1)/n * S/B
  all-gather, reduce-scatter,
  broadcast (pipelined ring)      (n-1) alpha +  (n-1)/n * S/B

Where a backend's times do not follow one line in S (gloo on CPU: its all-gather is
quick up to a few tens of MiB and then falls off a cliff, its reduce-scatter is slower
than its all-reduce at every size that matters), a link carries the measured times
themselves, per op, and the time of a collective is read off them.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable

from sim.ledger import LedgerEntry


def _hops(op: str, n: int) -> int:
    return 2 * (n - 1) if op == "all_reduce" else n - 1


@dataclass(frozen=True)
class Link:
    alpha_s: float    # per-hop latency
    bandwidth: float  # bus bandwidth, bytes/s
    # Where one bandwidth does not fit every collective, a fitted bandwidth per op overrides it.
    op_bandwidth: dict[str, float] = field(default_factory=dict)
    # Measured: op -> ((bytes each rank sends in a ring, seconds), ...) in ascending bytes, taken
    # on a group of `measured_ranks`. Between points the time is interpolated, past the last one
    # scaled with the bytes; another group size adds or removes alpha per hop.
    op_seconds: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    measured_ranks: int = 2
    # The fraction of the device's compute a collective on this link takes while it runs beside it
    # (NCCL's kernels occupy SMs; more to drive NVLink than a NIC)
    compute_share: float = 0.0

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or min([self.bandwidth, *self.op_bandwidth.values()]) <= 0:
            raise ValueError(f"a link needs alpha >= 0 and bandwidths > 0, got {self}")
        if not 0 <= self.compute_share < 1:
            raise ValueError(f"a link's compute_share is a fraction in [0, 1), got {self.compute_share}")
        for op, points in self.op_seconds.items():
            sizes = [s for s, _ in points]
            if len(points) < 2 or sizes != sorted(set(sizes)) or min(t for _, t in points) < 0:
                raise ValueError(f"measured times of {op} need 2 or more points in ascending bytes, got {points}")

    def bandwidth_of(self, op: str) -> float:
        return self.op_bandwidth.get(op, self.bandwidth)

    def time(self, op: str, ring_bytes: float, n: int) -> float:
        """Seconds for one collective `op` over `n` ranks, each sending `ring_bytes`."""
        if n <= 1:
            return 0.0
        points = self.op_seconds.get(op)
        if points is None:
            return _hops(op, n) * self.alpha_s + ring_bytes / self.bandwidth_of(op)
        extra_hops = (_hops(op, n) - _hops(op, self.measured_ranks)) * self.alpha_s
        return max(0.0, _interpolate(points, ring_bytes) + extra_hops)


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear through the points; the first point's time below it (the latency floor),
    and beyond the last point that point's bandwidth: its time scaled by x over its bytes. (Not
    the last segment's slope: medians of noisy neighbours can make it flat or negative.)"""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1] * x / points[-1][0]
    i = bisect.bisect_left([s for s, _ in points], x)
    (x0, t0), (x1, t1) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (x - x0) / (x1 - x0)


def collective_time(entry: LedgerEntry, link: Link) -> float:
    return link.time(entry.op, entry.ring_bytes_per_rank, entry.group_size)


@dataclass(frozen=True)
class Replay:
    exposed_s: float  # the step's seconds beyond its compute spent on collectives
    slowed_s: float   # the compute's own seconds lost to collectives running beside it


def replay(entries: list[LedgerEntry], events: Iterable[tuple[str, int, float]], links: dict[str, Link],
           compute_s: float) -> Replay:
    """A step of `compute_s` of compute, replayed with its collectives from the planner's schedule
    (Ledger.events: each launched, and first waited for, at a point of the compute). Each group's
    collectives run one at a time in launch order on their own stream, as a process group's do; a launch
    starts when the stream is free; a wait stalls the compute until the collective is done (a blocking one:
    for itself and whatever was queued ahead of it). What is still running when the compute ends (the last
    reductions, the replicas' average after backward) is exposed too: nothing is left to hide it.

    While a collective runs beside the compute it takes its link's `compute_share` of the device (SMs for
    NCCL's kernels): the compute loses that share of the time they overlap. (Not fed back into the
    schedule: the later launches are not moved by it.)"""
    stall, free, done, spans, stalls = 0.0, {}, {}, [], []
    for kind, i, at in events:
        now, entry = at + stall, entries[i]
        if kind == "launch":
            start = max(now, free.get(entry.group, 0.0))
            done[i] = free[entry.group] = start + collective_time(entry, links[entry.group])
            spans.append((start, done[i], links[entry.group].compute_share))
        elif done[i] > now:
            stalls.append((now, done[i]))
            stall += done[i] - now
    end = compute_s + stall
    stalled = _stalled_before(stalls)
    slowed = sum(share * (max(0.0, min(b, end) - max(a, 0.0)) - (stalled(min(b, end)) - stalled(min(a, end))))
                 for a, b, share in spans if share and a < end)
    return Replay(stall + max(0.0, max(free.values(), default=0.0) - end), slowed)


def _stalled_before(stalls: list[tuple[float, float]]):
    """t -> the seconds of `stalls` (disjoint intervals in order) before t."""
    starts, done = [a for a, _ in stalls], [0.0]
    for a, b in stalls:
        done.append(done[-1] + b - a)

    def before(t: float) -> float:
        i = bisect.bisect_right(starts, t)
        return 0.0 if i == 0 else done[i - 1] + min(t, stalls[i - 1][1]) - stalls[i - 1][0]
    return before


def ledger_time(entries: Iterable[LedgerEntry], link: Link | dict[str, Link]) -> float:
    """Seconds of the entries' collectives, each on its group's link (`link`: one for all, or by group name)."""
    return sum(collective_time(e, link if isinstance(link, Link) else link[e.group]) for e in entries)


# Another op stands in for a collective only if it takes at most this fraction of its time:
# medians of gloo's small collectives scatter by more than 10% on these machines (scheduler
# stalls), and an all-gather done as an all-reduce also fills the buffer with zeros first.
STAND_IN_MARGIN = 0.9

# What may stand in for each collective, besides itself. A reduce-scatter: an all-reduce of the
# whole buffer (twice the bytes; gloo's reduce-scatter is the slower op). An all-gather: an
# all-reduce of the buffer zero but for this rank's slot, or one broadcast per rank from its slot
# (the same bytes as the all-gather, each sent once by its owner; gloo broadcasts quicker than it
# gathers).
STAND_INS = {"reduce_scatter": ("all_reduce",), "all_gather": ("all_reduce", "broadcast")}


def _time_as(op: str, nbytes: int, n: int, link: Link) -> float:
    if op == "broadcast":  # one per rank, of its slot
        return n * collective_time(LedgerEntry("broadcast", "", nbytes // n, n), link)
    return collective_time(LedgerEntry(op, "", nbytes, n), link)


def issued_as(op: str, nbytes: int, n: int, link: Link | None) -> str:
    """The op that a reduce-scatter or all-gather of `nbytes` (the full buffer) over `n` ranks is
    issued as: the quickest by the link's rates of the op itself and its stand-ins, where that is
    clearly quicker (STAND_IN_MARGIN); else the op itself. On a link with one bandwidth for every
    op (NCCL's profiles) a stand-in moves as many bytes or more in more steps, and never wins."""
    if link is None or n <= 1 or op not in STAND_INS:
        return op
    own = _time_as(op, nbytes, n, link)
    best = min(STAND_INS[op], key=lambda alt: _time_as(alt, nbytes, n, link))
    return best if _time_as(best, nbytes, n, link) < STAND_IN_MARGIN * own else op
