"""How a unit's weights enter the step compiled whole (zerofunc/whole_step.py), and its gradient leaves: stage 3's
gather under a recompute policy, a unit's flat weights as its parameters with one concatenation for their
gradient, and where an fp32 master lies in the weights it updates."""
from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from zerofunc.collectives import Group, gathered, reduced_gradient


class _KnownCheckpointWarning(logging.Filter):
    """torch warns that a checkpointed region with a context_fn must hold no in-place op: stage 3's region
    holds one gather, nothing in place, so every rank's log need not say it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_KnownCheckpointWarning())


def recompute_gathers(ctx, func, *args, **kwargs):
    """Stage 3's policy over the region that gathers a unit's weights, and only that: recomputed in
    backward, never kept for it (the gather, the parameters read from it)."""
    return CheckpointPolicy.MUST_RECOMPUTE


def regathered(gather, *args) -> tuple[torch.Tensor, ...]:
    """`gather(*args)` (stage 3's parameters from every rank's shard) under `recompute_gathers`: backward
    gathers them again rather than keep them from forward."""
    return checkpoint(gather, *args, use_reentrant=False, preserve_rng_state=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, recompute_gathers))


def _parameters(whole: torch.Tensor, slots: tuple) -> tuple[torch.Tensor, ...]:
    """The parameters a unit's flat weights hold, views of them (the layout's slots, in order from offset 0)."""
    views, at = [], 0
    for numel, shape in slots:
        views.append(whole[at:at + numel].view(shape))
        at += numel
    return tuple(views)


def _flat_gradient(ctx, grads: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The parameters' gradients as one flat gradient of the unit's weights (zeros for a parameter none
    reached, and for the padding to equal shards): one concatenation."""
    zeros = functools.partial(torch.zeros, dtype=ctx.dtype, device=ctx.device)
    pieces = [g.reshape(-1) if g is not None else zeros(numel) for (numel, _), g in zip(ctx.slots, grads)]
    tail = ctx.numel - sum(numel for numel, _ in ctx.slots)
    return torch.cat(pieces + ([zeros(tail)] if tail else []))


class Unflattened(torch.autograd.Function):
    """Stages 0-2: a unit's whole weights as its parameters, whose gradient is one concatenation. Not a slice
    per parameter: each slice differentiates into a zero-padded copy of the whole buffer and the copies are
    summed, which inductor fuses into one pass that loads once per parameter (a 30m block's 12: 23 ms on
    this CPU, where a concatenation copies once). Not one split: a split's views are outputs of one
    multi-output op, which dynamo refuses to hand to an autograd Function that returns its input (the tied
    embedding)."""

    @staticmethod
    def forward(whole: torch.Tensor, slots: tuple) -> tuple[torch.Tensor, ...]:
        return _parameters(whole, slots)

    @staticmethod
    def setup_context(ctx, inputs, output):
        whole, ctx.slots = inputs
        ctx.numel, ctx.dtype, ctx.device = whole.numel(), whole.dtype, whole.device

    @staticmethod
    def backward(ctx, *grads):
        return _flat_gradient(ctx, grads), None


class GatheredParameters(torch.autograd.Function):
    """Stage 3: a unit's parameters, views of its gathered weights, as `Unflattened` makes them; their gradient,
    one concatenation, reduce-scattered onto `shard`, this rank's, as the unit's backward ends. One op, not
    an identity whose backward reduces and then `Unflattened`: no copy of the gathered weights to remove."""

    @staticmethod
    def forward(shard: torch.Tensor, whole: torch.Tensor, group: Group, slots: tuple) -> tuple[torch.Tensor, ...]:
        return _parameters(whole, slots)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, whole, ctx.group, ctx.slots = inputs
        ctx.numel, ctx.dtype, ctx.device = whole.numel(), whole.dtype, whole.device

    @staticmethod
    def backward(ctx, *grads):
        return reduced_gradient(_flat_gradient(ctx, grads), ctx.group, True), None, None, None


def gathered_parameters(shard: torch.Tensor, group: Group, slots: tuple) -> tuple[torch.Tensor, ...]:
    """Stage 3: a unit's parameters, from every rank's shard; their gradient reduce-scattered onto `shard`."""
    return GatheredParameters.apply(shard, gathered(shard.detach(), group), group, slots)


def whole_parameters(whole: torch.Tensor, slots: tuple) -> tuple[torch.Tensor, ...]:
    """Frozen parameters (no gradient): views of their whole flat buffer (stages 0-2)."""
    return _parameters(whole.detach(), slots)


def gathered_frozen(shard: torch.Tensor, group: Group, slots: tuple) -> tuple[torch.Tensor, ...]:
    """Stage 3: frozen parameters, views of every rank's shard gathered; no gradient, so no reduction."""
    return _parameters(gathered(shard.detach(), group), slots)


def span_in(master: torch.Tensor, params: torch.Tensor) -> Optional[tuple[int, int]]:
    """Where the fp32 master lies inside the weights' buffer, when it is a slice of it (fp32, not offloaded)."""
    if master.dtype != params.dtype or master.untyped_storage().data_ptr() != params.untyped_storage().data_ptr():
        return None
    lo = master.storage_offset() - params.storage_offset()
    return lo, lo + master.numel()
