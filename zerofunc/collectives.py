"""Every collective of a training step, one function each, named for what it moves; the tag it carries in
the ledger (sim/ledger.py) is the one the planner counts. Eager, each is a Communicator's op (zerofunc/comm.py)
on buffers in place, returning the handle to wait on; compiled whole (zerofunc/whole_step.py), a functional
collective whose result is a value in the graph.

A stage-3 step, in the order it issues them (eager; the step compiled whole issues the same, bucketed):

    data_parallel_sum(token counts)                      "tokens"       zerofunc/step.py, before the forward
    for each unit the forward enters:
        gather_weights(unit)                             "params.fwd"   zerofunc/gather.py, and the next
                                                                         blocks' (the prefetch depth, in the
                                                                         order the last forward ran them)
    for each unit backward reaches, last first:
        gather_weights(unit)                             "params.bwd"   zerofunc/gather.py (hpZ: from the node)
        reduce_scatter_gradient(unit's gradient)         "grads"        zerofunc/reduction.py
    [hybrid sharding] average_over_replicas(shard)       "grads.replicas"
    sum_over_ranks(squared norms)                        "grad_norm"    zerofunc/sharded_optim.py
    data_parallel_sum(loss, mean=True)                   "metrics"      zerofunc/step.py

Stages 1-2 gather no weights forward or backward; they gather the updated shards after AdamW
("params.step"). Stage 0 all-reduces each gradient whole (`all_reduce_gradient`) at the accumulation
boundary, as stage 1 reduce-scatters it then; stages 2-3 reduce every micro-step.

Compiled whole, each collective is issued as the op the eager communicator issues in its place (zerofunc/comm.py,
sim.cost.issued_as): on gloo an all-gather as one broadcast per rank (into one buffer:
zerofunc/broadcast_gather.py) and a large reduce-scatter as an all-reduce, which gloo runs 2-6x faster than
its own all-gather and reduce-scatter (measured on this project's CPU machines: 32 MB over 2 ranks, all-gather
55 ms against 11.5 ms of broadcasts, reduce-scatter 71 ms against a 31 ms all-reduce); on NCCL's links the
paper's ops. So the compiled step sends what the eager step sends, op for op.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol

from sim.cost import Link, issued_as
from zerofunc.broadcast_gather import broadcast_gather, broadcast_gather_into
from zerofunc.comm import Communicator, Handle

# ---- eager: a Communicator's op on buffers in place; the handle is waited on by the caller ------------------------
def gather_weights(comm: Communicator, whole: torch.Tensor, shard: torch.Tensor, tag: str,
                   async_op: bool = False) -> Handle:
    """Every rank's `shard` of a unit's weights, concatenated into `whole`. `tag`: "params.fwd" and "params.bwd"
    (stage 3, before a unit's forward and its backward), "params.step" (stages 1-2, the shards AdamW updated);
    "params.load" and "export" outside the step."""
    return comm.all_gather(whole, shard, tag=tag, async_op=async_op)


def all_reduce_gradient(comm: Communicator, grad: torch.Tensor, async_op: bool = False) -> Handle:
    """Stage 0: a unit's whole gradient, averaged over the ranks in place ("grads")."""
    return comm.all_reduce(grad, tag="grads", async_op=async_op)


def reduce_scatter_gradient(comm: Communicator, shard: Optional[torch.Tensor], grad: torch.Tensor,
                            async_op: bool = False) -> Handle:
    """Stages 1-3: this rank's shard of a unit's gradient averaged over the ranks, into `shard` (None: into
    `grad`'s own slot, as stage 1 keeps the whole gradient) ("grads")."""
    return comm.reduce_scatter(shard, grad, tag="grads", async_op=async_op)


def average_over_replicas(replicas: Communicator, shard: torch.Tensor, async_op: bool = False) -> Handle:
    """Hybrid sharding: a gradient shard averaged over the ranks holding the same shard in the other shard
    groups, once a step ("grads.replicas")."""
    return replicas.all_reduce(shard, tag="grads.replicas", async_op=async_op)


def sum_over_ranks(comm: Communicator, stats: torch.Tensor) -> None:
    """Stages 1-3: the gradient shards' squared norms (and fp16's found-inf) summed over the ranks, for the
    global norm ("grad_norm")."""
    comm.all_reduce(stats, tag="grad_norm", mean=False)


def data_parallel_sum(comm: Communicator, replicas: Optional[Communicator], t: torch.Tensor, tag: str,
                      mean: bool = False) -> None:
    """`t` summed (or averaged) over every data-parallel rank: the shard group, then the replicas (equal groups,
    so the mean of their means is the mean). "tokens": the global batch's counted targets; "metrics": the
    logged loss, averaged."""
    comm.all_reduce(t, tag=tag, mean=mean)
    if replicas is not None:
        replicas.all_reduce(t, tag=tag, mean=mean)


def alike_on_every_rank(comm: Communicator, replicas: Optional[Communicator], value: int, device) -> bool:
    """Whether every data-parallel rank holds the same small integer `value` (below 2**20): the sums of 1, v
    and v*v, of which n * sum(v*v) == sum(v)**2 only when every v is the same; exact in float64 up to 2**10
    ranks, and the same answer on every rank. Tagged "debug": only TORCH_DISTRIBUTED_DEBUG=DETAIL issues it."""
    sums = torch.tensor([1.0, value, float(value) ** 2], dtype=torch.float64, device=device)
    data_parallel_sum(comm, replicas, sums, "debug")
    n, s, q = sums.tolist()
    return n * q == s * s


# ---- compiled whole: functional collectives, values in the graph ----------------------------------------------------

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
    `whole_weights.GatheredParameters`)."""
    op = group.gather_op
    if op == "broadcast":  # each rank's slot from it, broadcast into one buffer (zerofunc/broadcast_gather.py)
        return funcol.wait_tensor(broadcast_gather(shard, group.world, group.name))
    if op == "all_reduce":  # -0.0 in the other ranks' slots: x + -0.0 is x, bit for bit (zerofunc/comm.py)
        def filler(ranks: int) -> torch.Tensor:
            return shard.new_full((ranks * shard.numel(),), -0.0)
        return funcol.all_reduce(torch.cat([filler(group.rank), shard, filler(group.world - group.rank - 1)]), "sum",
                                 group.name)
    return _all_gather(shard, 0, group.name)


def gathered_into(weights: torch.Tensor, shard: torch.Tensor, group: Group) -> None:
    """`weights` written with every rank's `shard`, in rank order: on gloo's broadcasts straight into them,
    as the eager step gathers (zerofunc/broadcast_gather.py), else through `gathered`'s fresh buffer (funcol's
    `all_gather_into_tensor_out` into the weights compiles to that buffer and a copy too, torch 2.13; on a GPU
    the copy runs at HBM's bandwidth: about 10 ms a step for Llama-3-8B's 16 GB of bf16 weights on an H100)."""
    if group.gather_op == "broadcast":
        broadcast_gather_into(weights, shard, group.world, group.name)
        funcol.wait_tensor(weights)
    else:
        weights.copy_(gathered(shard, group))


def scattered_gradient(grad: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's shard of the sum of every rank's `grad`."""
    if group.scatter_op == "all_reduce":
        n = grad.numel() // group.world
        return funcol.all_reduce(grad, "sum", group.name)[group.rank * n:(group.rank + 1) * n].clone()
    return funcol.reduce_scatter_tensor(grad, "sum", 0, group.name)


def reduced_into(grad: torch.Tensor, group: Group, scatter: bool) -> torch.Tensor:
    """`reduced_gradient` of a graph's input `grad`, the sum written into `grad` itself where it is whole (stage
    0, and stage 1's all-reduce): funcol's all-reduce copies its input first, and a graph input written with
    the result is the one case inductor issues it in place (its reinplacing, torch 2.13), so each gradient is
    reduced where it lies, as the eager step reduces it: one gradient-sized buffer less at the step's peak
    (2 gloo ranks, 30.5M fp32 in 7 gradients, with their norm: 115 ms a call against 137 with the copies;
    the step's time did not move, docs/BENCHMARKS.md). `grad` holds the sum afterwards; at stage 1 only
    this rank's slot of it is returned."""
    if scatter and group.scatter_op != "all_reduce":
        return scattered_gradient(grad, group)
    grad.copy_(summed(grad, group))
    if not scatter:
        return grad
    n = grad.numel() // group.world
    return grad[group.rank * n:(group.rank + 1) * n]


def summed(t: torch.Tensor, group: Group) -> torch.Tensor:
    """`t` summed over the group's ranks: stage 0's gradients, and the squared norms."""
    return funcol.all_reduce(t, "sum", group.name)


def reduced_gradient(grad: torch.Tensor, group: Group, scatter: bool) -> torch.Tensor:
    """A unit's gradient summed over the group's ranks: this rank's shard of the sum (`scatter`: stages 1-3),
    or the whole sum (stage 0)."""
    return scattered_gradient(grad, group) if scatter else summed(grad, group)


GATHER = gathered.__name__  # as a compiled graph's stack traces name it: a collective issued from there gathers


class ReducedGradient(torch.autograd.Function):
    """The whole weights, as they are; their gradient reduced as the unit's backward ends, with `accumulated`
    (the accumulation's earlier micro-batches' sum, or None) added first: reduce-scattered onto `leaf`, this
    rank's shard (`scatter`: stages 1-2), or summed whole onto `leaf`, the whole weights (stage 0)."""

    @staticmethod
    def forward(leaf, whole, group, accumulated, scatter):
        # a copy, not a view: where the model breaks the graph (Hugging Face's GPT-2 does, at a warning) the
        # weights leave a graph as its outputs, and AOTAutograd regenerates an output that aliases an input
        # needing no gradient (stage 2's whole weights) from that input, cutting this function off: no
        # gradient would reach the shard. Inside one graph inductor removes the copy (its noop pass; measured
        # at stage 2: the forward saves the same bytes with it as without). Since the weights go on through
        # whole_weights.py's _Unflattened, a view keeps its gradient too (tests/plant_register/whole_step.py);
        # the copy stays, free inside a graph, for a model whose graph breaks elsewhere
        return whole.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, ctx.group, accumulated, ctx.scatter = inputs
        ctx.save_for_backward(accumulated)

    @staticmethod
    def backward(ctx, grad):
        accumulated, = ctx.saved_tensors
        if accumulated is not None:
            grad = grad + accumulated
        return reduced_gradient(grad, ctx.group, ctx.scatter), None, None, None, None


class LeftOutGradient(ReducedGradient):
    """ReducedGradient for a unit the accumulation boundary's forward did not run: `whole` is the loss, passed
    on as it is, and backward reduces the earlier micro-batches' sum `accumulated` onto `leaf` alone."""

    @staticmethod
    def backward(ctx, grad):
        accumulated, = ctx.saved_tensors
        return reduced_gradient(accumulated, ctx.group, ctx.scatter), grad, None, None, None
