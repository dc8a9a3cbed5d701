"""How a unit's weights enter the step compiled whole (zerofunc/whole_step.py), and its gradient leaves: stage 3's
gather under a recompute policy, a unit's flat weights as its parameters with one concatenation for their
gradient, and where an fp32 master lies in the weights it updates."""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy

from zerofunc.collectives import Group, ReducedGradient, gathered


class _KnownCheckpointWarning(logging.Filter):
    """torch warns that a checkpointed region with a context_fn must hold no in-place op: stage 3's region
    holds one gather, nothing in place, so every rank's log need not say it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_KnownCheckpointWarning())


def recompute_gathers(ctx, func, *args, **kwargs):
    """Stage 3's policy over the region that gathers a unit's weights, and only that: recomputed in
    backward, never kept for it (the gather, and for its stand-ins the slots' concatenation)."""
    return CheckpointPolicy.MUST_RECOMPUTE


def gathered_with_gradient(shard: torch.Tensor, group: Group) -> torch.Tensor:
    """Stage 3: every rank's shard, whole; its gradient reduce-scattered onto this rank's shard."""
    return ReducedGradient.apply(shard, gathered(shard.detach(), group), group, None, True)


class Unflattened(torch.autograd.Function):
    """A unit's whole weights as its parameters (the layout's slots, in order from offset 0), whose gradient
    is one concatenation. Not a slice per parameter: each slice differentiates into a zero-padded copy of
    the whole buffer and the copies are summed, which inductor fuses into one pass that loads once per
    parameter (a 30m block's 12: 23 ms on this CPU, where a concatenation copies once). Not one split: a
    split's views are outputs of one multi-output op, which dynamo refuses to hand to an autograd
    Function that returns its input (the tied embedding)."""

    @staticmethod
    def forward(whole: torch.Tensor, slots: tuple) -> tuple[torch.Tensor, ...]:
        views, at = [], 0
        for numel, shape in slots:
            views.append(whole[at:at + numel].view(shape))
            at += numel
        return tuple(views)

    @staticmethod
    def setup_context(ctx, inputs, output):
        whole, slots = inputs
        ctx.slots, ctx.numel, ctx.dtype, ctx.device = slots, whole.numel(), whole.dtype, whole.device

    @staticmethod
    def backward(ctx, *grads):
        zeros = functools.partial(torch.zeros, dtype=ctx.dtype, device=ctx.device)
        pieces = [g.reshape(-1) if g is not None else zeros(numel) for (numel, _), g in zip(ctx.slots, grads)]
        tail = ctx.numel - sum(numel for numel, _ in ctx.slots)  # the padding to equal shards
        return torch.cat(pieces + ([zeros(tail)] if tail else [])), None


def span_in(master: torch.Tensor, params: torch.Tensor) -> Optional[tuple[int, int]]:
    """Where the fp32 master lies inside the weights' buffer, when it is a slice of it (fp32, not offloaded)."""
    if master.dtype != params.dtype or master.untyped_storage().data_ptr() != params.untyped_storage().data_ptr():
        return None
    lo = master.storage_offset() - params.storage_offset()
    return lo, lo + master.numel()
