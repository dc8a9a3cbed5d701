"""Communication time from a ledger, with the ring alpha-beta model.

n ranks, S bytes of payload, link latency alpha and bus bandwidth B:
  all-reduce                     2(n-1) alpha + 2(n-1)/n * S/B
  all-gather, reduce-scatter,
  broadcast (pipelined ring)      (n-1) alpha +  (n-1)/n * S/B
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from sim.ledger import LedgerEntry


@dataclass(frozen=True)
class Link:
    alpha_s: float    # per-hop latency
    bandwidth: float  # bus bandwidth, bytes/s
    # Where one bandwidth does not fit every collective (gloo on CPU: its all-reduce is
    # faster than its all-gather), a measured bandwidth per op overrides it.
    op_bandwidth: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or min([self.bandwidth, *self.op_bandwidth.values()]) <= 0:
            raise ValueError(f"a link needs alpha >= 0 and bandwidths > 0, got {self}")

    def bandwidth_of(self, op: str) -> float:
        return self.op_bandwidth.get(op, self.bandwidth)


def collective_time(entry: LedgerEntry, link: Link) -> float:
    n = entry.group_size
    if n <= 1:
        return 0.0
    hops = 2 * (n - 1) if entry.op == "all_reduce" else n - 1
    return hops * link.alpha_s + entry.ring_bytes_per_rank / link.bandwidth_of(entry.op)


def ledger_time(entries: Iterable[LedgerEntry], link: Link) -> float:
    return sum(collective_time(e, link) for e in entries)
