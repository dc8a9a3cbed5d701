"""Simulated worlds: be rank 0 of N ranks on one device, with PyTorch's fake process group.

`dist.init_process_group("fake", ...)` gives a process group whose collectives move no
data and return at once, while every tensor the step allocates is real: gathered units,
gradient buckets, staging, optimizer shards. The project's `DistCommunicator` runs over
it unchanged, so what a simulated world measures (memory, the ledger, time) is the code
that trains. This is how PyTorch checks FSDP's memory without N GPUs.

What the data means: every rank is taken to be rank 0's twin. The fake group already
behaves so for all-gathers (each rank's slot receives rank 0's shard) and all-reduces
(rank 0's buffer is left as is: the mean of N equal buffers). Its reduce-scatter leaves
the output untouched in torch 2.11 (2.13 copies rank 0's slice), which would leave a
gradient shard of uninitialized memory; `TwinCommunicator` writes that slice itself,
when the group does not, so losses stay finite and every step updates the weights. An
all-gather issued as an all-reduce (where the stood-in backend's rates choose so) would
leave zeros in the other slots; it tiles rank 0's shard there. Those writes are copies
between existing buffers: no allocation, no ledger entry.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.distributed as dist

from zerofunc.comm import (GLOO_STAGING, DistCommunicator, Handle, backend_link, hybrid_communicators,
                           reduce_scatter_single)
from zerofunc.layout import shard


class TwinCommunicator(DistCommunicator):
    """`DistCommunicator` on a fake group, with the twin-world reduce-scatter where the group lacks it."""

    def __init__(self, stands_in_for: str, group=None, ledger=None):
        super().__init__(group, ledger, link=backend_link(stands_in_for, dist.get_world_size(group)))
        self.stands_in_for = stands_in_for
        # The backend this world stands in for stages what it would stage (declared, as
        # the communicator always does), so the tracker counts what a real run counts,
        # and chooses its collectives by that backend's rates.
        self.staging = dict(GLOO_STAGING) if stands_in_for == "gloo" else {}
        self._write_scatter = not _fake_reduce_scatter_writes()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "", async_op: bool = False) -> Handle:
        stood_in = self.gather_op(out) != "all_gather"
        handle = super().all_gather(out, inp, tag, async_op)
        if stood_in:  # a fake all-reduce or broadcast leaves the other slots as they were:
            # tile rank 0's shard, as its twins hold it
            out.view(self.world_size, -1).copy_(inp.view(1, -1).expand(self.world_size, -1))
        return handle

    def _run(self, op: str, async_op: bool, **kw) -> Handle:
        work = super()._run(op, async_op, **kw)
        if op == "reduce_scatter" and self._write_scatter:
            kw["out"].copy_(shard(kw["inp"], self.rank, self.world_size))  # the mean of N equal inputs
        if op == "all_reduce" and not kw.get("mean", False):  # the fake group leaves rank 0's value: the sum of
            kw["out"].mul_(self.world_size)  # N equal twins is N times it (a token count, a squared norm)
        return work


@functools.cache
def _fake_reduce_scatter_writes() -> bool:
    """Whether this torch's fake group writes a reduce-scatter's output (2.13 does, 2.11 does not)."""
    out = torch.zeros(1)
    reduce_scatter_single(out, torch.ones(dist.get_world_size()))
    return out.item() == 1.0


def twin_groups(world: TwinCommunicator, shard_group: int) -> tuple[TwinCommunicator, TwinCommunicator]:
    """Hybrid sharding in a simulated world: rank 0's shard group and replica group, as twins of the
    backend `world` stands in for (fake subgroups: torch.distributed.new_group on the fake group)."""
    return hybrid_communicators(shard_group, make=lambda group, ledger=None: TwinCommunicator(
        world.stands_in_for, group, ledger))


def stood_in_backend(device: torch.device) -> str:
    """The backend a simulated world stands in for: gloo on CPU, NCCL on CUDA."""
    return "gloo" if device.type == "cpu" else "nccl"


@contextlib.contextmanager
def simulated_world(world_size: int, device: torch.device | str = "cpu") -> Iterator[TwinCommunicator]:
    """A fake process group of `world_size` ranks in which this process is rank 0; its communicator.

    It needs a process without a process group of its own, and ends the fake group on exit.
    """
    if world_size < 1:
        raise ValueError(f"a world needs at least 1 rank, got {world_size}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already running here; a simulated world needs a process of its own")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield TwinCommunicator(stood_in_backend(torch.device(device)))
    finally:
        dist.destroy_process_group()
