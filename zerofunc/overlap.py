"""How much communication runs behind compute, and the queue that bounds it.

Two knobs, as in DeepSpeed and FSDP:

- `prefetch_depth`: under stage 3, how many blocks ahead of the one computing are
  being gathered (forward: the next ones; backward: the previous ones). Each holds a
  whole gathered block, so the planner sees `1 + depth` blocks live at once.
- `bucket_bytes`: how many bytes of gradient reductions may be in flight before the
  engine waits for the oldest. A block's gradient is its own bucket, one flat buffer
  (so norms and biases never travel alone); the cap bounds what stays allocated
  for collectives that have not finished: stages 2-3 keep each block's whole gradient
  until its reduce-scatter completes. 0 makes every reduction synchronous.

Both are plan fields: the simulation runs the same queue, so it holds the same buffers
for as long as the trainer does.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from zerofunc.comm import Handle

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's bucket_cap_mb


@dataclass(frozen=True)
class Overlap:
    prefetch_depth: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.prefetch_depth < 0 or self.bucket_bytes < 0:
            raise ValueError(f"prefetch depth and bucket size must be >= 0, got {self.prefetch_depth} "
                             f"and {self.bucket_bytes}")


NO_OVERLAP = Overlap(prefetch_depth=0, bucket_bytes=0)


class InFlight:
    """Collectives launched and not yet waited on, oldest first, each with what to do once it is done.

    Adding one past `limit` bytes waits for the oldest until the rest fit. `drain()`
    waits for all, in launch order, so completions run in the same order on every rank.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self._queue: deque[tuple[Handle, int, Optional[Callable[[], None]], tuple]] = deque()

    def overlaps(self, nbytes: int) -> bool:
        """Whether a collective of `nbytes` can run in flight; a larger one would be waited for at once,
        so it is better issued blocking."""
        return nbytes <= self.limit

    def add(self, handle: Handle, nbytes: int, done: Optional[Callable[[], None]] = None,
            holds: tuple = ()) -> None:
        """Queue `handle`; `holds` are tensors the collective reads, kept alive until it is done."""
        self._queue.append((handle, nbytes, done, holds))
        self.bytes += nbytes
        while self._queue and self.bytes > self.limit:
            self._finish_oldest()

    def drain(self) -> None:
        while self._queue:
            self._finish_oldest()

    def __len__(self) -> int:
        return len(self._queue)

    def _finish_oldest(self) -> None:
        handle, nbytes, done, _ = self._queue.popleft()
        handle.wait()
        self.bytes -= nbytes
        if done is not None:
            done()
