"""The communication ledger: one entry per collective a step issues.

Both the real communicator and the recording one append here, so an executed step
and a simulated one can be compared entry by entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Ops and how many times their payload counts in the ZeRO paper's sense: an all-reduce
# is a reduce-scatter followed by an all-gather, so it moves its payload twice.
VOLUME_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}


@dataclass(frozen=True)
class LedgerEntry:
    """One collective.

    `nbytes` is the size of the full (unsharded) payload: the output of an all-gather,
    the input of a reduce-scatter, the buffer of an all-reduce or broadcast.
    `tag` says what the bytes are for (e.g. "grads", "params.fwd"), so a reader can
    separate the optimizer's traffic from bookkeeping such as the logged loss.
    `overlapped` says it was launched asynchronously, to run behind compute.
    `group` names the ranks it ran over: "world", or under hybrid sharding "shard" (a shard group)
    or "replicas" (the ranks holding the same shard in every group); each is costed on its own link.
    """

    op: str
    dtype: str
    nbytes: int
    group_size: int
    tag: str = ""
    overlapped: bool = False
    group: str = "world"

    def __post_init__(self) -> None:
        if self.op not in VOLUME_FACTOR:
            raise ValueError(f"unknown collective {self.op!r}")

    @property
    def volume_bytes(self) -> int:
        """Bytes counted as in the ZeRO paper: all-reduce 2S, all-gather/reduce-scatter S."""
        return VOLUME_FACTOR[self.op] * self.nbytes

    @property
    def ring_bytes_per_rank(self) -> float:
        """Bytes each rank actually sends in a ring implementation: (n-1)/n of the volume."""
        n = self.group_size
        return self.volume_bytes * (n - 1) / n if n > 1 else 0.0


@dataclass
class Ledger:
    entries: list[LedgerEntry] = field(default_factory=list)
    # The planner's schedule (a communicator with a clock, zerofunc/comm.py): ("launch" or "wait", the entry's
    # index, the step's compute seconds at that moment), in program order; a collective's first wait only.
    events: list[tuple[str, int, float]] = field(default_factory=list)

    def append(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)

    def clear(self) -> None:
        self.entries.clear()
        self.events.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def select(self, *tags: str) -> list[LedgerEntry]:
        """Entries whose tag starts with one of `tags` (all entries if none given)."""
        if not tags:
            return list(self.entries)
        return [e for e in self.entries if e.tag.startswith(tags)]

    def volume_bytes(self, *tags: str) -> int:
        return sum(e.volume_bytes for e in self.select(*tags))
