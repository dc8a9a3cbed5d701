"""An all-gather issued as one broadcast per rank, into one fresh buffer: how the step compiled whole gathers
where the eager communicator broadcasts (gloo's links, by their measured rates: zerofunc/comm.py,
sim.cost.issued_as).

Not funcol's broadcast: a functional broadcast copies its input into a fresh buffer, one per rank's slot, and
the slots are then concatenated, so each gathered byte is written three times where the eager step writes it
once (gloo broadcasts straight into the slot). An in-place functional broadcast into a slot cannot be traced
(functionalization refuses c10d's alias annotations), and a custom op that mutates a slot is functionalized
into copies (both seen on torch 2.13). `broadcast_gather` is opaque to the compiler and returns a fresh tensor
(stage 3's gathered block; `broadcast_gather_into` writes into the weights instead, stages 1-2's): it copies
this rank's shard into its slot, issues the broadcasts asynchronously, in rank order on every rank (gloo pairs
them by issue order), and registers their completion with the buffer, so that `_c10d_functional.wait_tensor`,
traced after it and moved by zerofunc/comm_schedule.py, waits for them as it waits for a functional
collective. Measured on this project's CPU, 2 gloo ranks, under inductor: a 28 MB gather with a matmul
reading it, 52 ms a call, against 73 ms with funcol's broadcasts and the concatenation."""
from __future__ import annotations

import torch
import torch.distributed as dist


class _AllOf(dist.Work):
    """The broadcasts of one gather, complete when each is."""

    def __init__(self, works: list):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True


def _broadcast_slots(whole: torch.Tensor, shard: torch.Tensor, group_name: str) -> None:
    """Write this rank's `shard` into its slot of `whole` and issue the broadcast of every rank's slot into
    `whole`, registered with it for `_c10d_functional.wait_tensor`."""
    # torch's private API, imported where used: only a step compiled whole on gloo runs this
    from torch._C._distributed_c10d import _register_work
    from torch.distributed.distributed_c10d import _resolve_process_group
    group = _resolve_process_group(group_name)
    n, rank = shard.numel(), group.rank()
    whole[rank * n:(rank + 1) * n].copy_(shard)
    works = [dist.broadcast(whole[r * n:(r + 1) * n], src=dist.get_global_rank(group, r), group=group, async_op=True)
             for r in range(group.size())]
    _register_work(whole, _AllOf(works))


@torch.library.custom_op("zerofunc::broadcast_gather", mutates_args=())
def broadcast_gather(shard: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Every rank's `shard` of the group `group_name` (`world` ranks), concatenated in rank order; to be
    waited for with `_c10d_functional.wait_tensor` before it is read."""
    whole = shard.new_empty(world * shard.numel())
    _broadcast_slots(whole, shard, group_name)
    return whole


@broadcast_gather.register_fake
def _(shard: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    return shard.new_empty(world * shard.numel())


@torch.library.custom_op("zerofunc::broadcast_gather_into", mutates_args=("whole",))
def broadcast_gather_into(whole: torch.Tensor, shard: torch.Tensor, world: int, group_name: str) -> None:
    """`broadcast_gather` into `whole` (`world` times `shard`'s elements), where it is the weights the new shards
    go to (stages 1-2's update): functionalized, it is a copy of `whole` written back, which inductor turns into
    the op on the graph's input itself (its reinplacing of mutating custom ops), so that every gathered byte is
    written once, into the weights, as the eager step writes it. `world` is the ledger's (the group's size)."""
    _broadcast_slots(whole, shard, group_name)


@broadcast_gather_into.register_fake
def _(whole: torch.Tensor, shard: torch.Tensor, world: int, group_name: str) -> None:
    return None


BROADCAST_GATHER = torch.ops.zerofunc.broadcast_gather.default  # as a compiled graph's node targets it
BROADCAST_GATHER_INTO = torch.ops.zerofunc.broadcast_gather_into.default
