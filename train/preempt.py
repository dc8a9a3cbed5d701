"""Preemption: a SIGTERM or SIGINT ends the run at a step that every rank agrees on.

A signal may reach every rank at slightly different moments (the launcher forwards the
one it gets), or only some of them (torchrun on one node of several). So the ranks agree
through the process group's store instead of each stopping where it happens to be:

- at the top of each step t, a rank reads the store's key `stop after`;
- a rank that was signalled and finds no key proposes "stop after step t" with
  compare-and-set, so the first proposal wins and every rank reads the same one;
- a rank stops at the top of any step after the agreed one.

That is safe because no rank can be past the top of step t + 1 while another is at the
top of step t (step t's collectives need every rank), and every rank at the top of a step
<= t runs on to t. The store costs one round trip per step (about 0.1 ms here), outside
the collectives the planner counts.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from zerofunc.stop_signals import stop_signal

# torchrun can restart the workers against the same store; each attempt agrees anew
KEY = f"zerofunc/stop_after/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class StopAgreement:
    def __init__(self, store=None, signalled=stop_signal):
        # the group's own store (no new port); a test passes a store and a signal of its own
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.signalled = signalled
        self.agreed: tuple[int, str] | None = None  # (the last step to run, the signal that asked)

    def stop_before(self, step: int) -> bool:
        """Whether the run ends before `step` (call at the top of each step, on every rank)."""
        if self.agreed is None:
            if self.store.check([KEY]):
                self._read(self.store.get(KEY))
            elif self.signalled() is not None:
                self._read(self.store.compare_set(KEY, "", f"{step} {self.signalled()}"))
        return self.agreed is not None and step > self.agreed[0]

    def _read(self, value: bytes) -> None:
        last, signal_name = value.decode().split()
        self.agreed = (int(last), signal_name)
