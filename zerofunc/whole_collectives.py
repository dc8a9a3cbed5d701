"""The compiled step's collectives (zerofunc/whole_step.py): functional collectives, each a value in the graph,
each issued as the op the eager communicator issues in its place (zerofunc/comm.py, sim.cost.issued_as): on
gloo an all-gather as one broadcast per rank and a large reduce-scatter as an all-reduce, which gloo runs
2-6x faster than its own all-gather and reduce-scatter (measured on this project's CPU machines: 32 MB over
2 ranks, all-gather 55 ms against 11.5 ms of broadcasts, reduce-scatter 71 ms against a 31 ms all-reduce);
on NCCL's links the paper's ops. So the compiled step sends what the eager step sends, op for op.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol

from sim.cost import Link, issued_as

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch 2.13 renamed it


@dataclass(frozen=True)
class Group:
    """The ranks a unit is sharded over: the process group's name (what funcol takes), this rank, their
    number; and the ops the unit's all-gather and reduce-scatter are issued as, picked by the link's rates
    before anything is traced (`ops`): the choice is Python dynamo need not trace."""

    name: str
    rank: int
    world: int
    gather_op: str = "all_gather"
    scatter_op: str = "reduce_scatter"

    def ops(self, nbytes: int, link: Optional[Link]) -> "Group":
        """This group, its ops picked for a unit of `nbytes` (whole) on `link` (None: the paper's ops)."""
        return replace(self, gather_op=issued_as("all_gather", nbytes, self.world, link),
                       scatter_op=issued_as("reduce_scatter", nbytes, self.world, link))


def gathered(shard: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's `shard`, concatenated in rank order (not differentiable: stage 3 differentiates through
    `ReduceScatteredGradient`)."""
    op = group.gather_op
    if op == "broadcast":  # each rank's slot from it
        return torch.cat([funcol.broadcast(shard if r == group.rank else torch.empty_like(shard), r, group.name)
                          for r in range(group.world)])
    if op == "all_reduce":  # -0.0 in the other ranks' slots: x + -0.0 is x, bit for bit (zerofunc/comm.py)
        def filler(ranks: int) -> torch.Tensor:
            return shard.new_full((ranks * shard.numel(),), -0.0)
        return funcol.all_reduce(torch.cat([filler(group.rank), shard, filler(group.world - group.rank - 1)]), "sum",
                                 group.name)
    return _all_gather(shard, 0, group.name)


def scattered_gradient(grad: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's shard of the sum of every rank's `grad`. The ledger tags a collective issued from here
    "grads" (zerofunc/whole_step.py reads this function's name from the graph's stack traces)."""
    if group.scatter_op == "all_reduce":
        n = grad.numel() // group.world
        return funcol.all_reduce(grad, "sum", group.name)[group.rank * n:(group.rank + 1) * n].clone()
    return funcol.reduce_scatter_tensor(grad, "sum", 0, group.name)


SCATTER = scattered_gradient.__name__


class ReduceScatteredGradient(torch.autograd.Function):
    """The whole weights, as they are; their gradient reduce-scattered onto `shard`'s (stages 2-3)."""

    @staticmethod
    def forward(shard, whole, group):
        # a copy, not a view: where the model breaks the graph (Hugging Face's GPT-2 does, at a warning) the
        # weights leave a graph as its outputs, and AOTAutograd regenerates an output that aliases an input
        # needing no gradient (stage 2's whole weights) from that input, cutting this function off: no
        # gradient would reach the shard. Inside one graph inductor removes the copy (its noop pass; measured
        # at stage 2: the forward saves the same bytes with it as without)
        return whole.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return scattered_gradient(grad, ctx.group), None, None
