"""The update of the step compiled whole (zerofunc/whole_step.py): its two graphs, either side of the one host
read (the global norm, which decides a skip and the clipping, as the eager optimizer's), as functions of the
units they update. `units` are the engine's units with weights to train, `groups` each unit's ranks by name
(zerofunc/collectives.py)."""
from __future__ import annotations

from typing import Optional

import torch

from zerofunc.collectives import Group, gathered_into, reduced_into, summed


def reduced_and_norm(grads: list[torch.Tensor], units: list, groups: dict[str, Group], ranks: Group, stage,
                     reduce_here: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """With `reduce_here` (stages 0-1 reduced after backward), each unit's gradient summed over the ranks, this
    rank's shard (stage 1) or whole (stage 0), else none (backward reduced them); and the global norm of the
    averaged gradients. The sums are divided in the update, where AdamW reads them anyway: divided here, every
    gradient would be written once more (at 120m, 170 MB a rank and step)."""
    reduced, squares = [], []
    for unit, g in zip(units, grads):
        if reduce_here:
            g = reduced_into(g, groups[unit.name], stage.shard_optimizer)  # each gradient a graph input
            reduced.append(g)
        squares.append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
    total = torch.stack(squares).sum()
    if stage.shard_optimizer:
        total = summed(total, ranks)
    return reduced, total.sqrt() / ranks.world


def adamw_then_gather(grads: list[torch.Tensor], factor: torch.Tensor, lr: torch.Tensor, step: torch.Tensor,
                      units: list, spans: list[Optional[tuple[int, int]]], groups: dict[str, Group], stage,
                      world: int, cfg) -> None:
    """AdamW (as zerofunc.optim.adamw_, with the step a tensor) on each unit's fp32 shard, from the gradients
    summed over the `world` ranks; the weights the forward uses then follow it (gathered, at stages 1-2).
    `spans`: where each unit's fp32 master lies in its weights, if there (whole_weights.span_in)."""
    beta1, beta2 = cfg.betas
    gathering = stage.shard_optimizer and not stage.shard_params
    with torch.no_grad():
        for unit, span, g in zip(units, spans, grads):
            # an fp32 master is a slice of the weights: taken here, so that the graph's input is the weights
            # alone (two aliasing inputs, one written, would be copied whole on every step)
            master = unit.params[span[0]:span[1]] if span is not None else unit.master
            g = g / world  # summed, by backward's reductions or the reduce graph's
            g = g.float() * factor
            unit.m.lerp_(g, 1 - beta1)
            unit.v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (unit.v.sqrt() / torch.sqrt(1 - beta2 ** step)).add_(cfg.eps)
            new = master * (1 - lr * cfg.weight_decay) - unit.m / denom * (lr / (1 - beta1 ** step))
            # the new master as a value, written once: at stages 1-2 an fp32 master is this rank's slot of the
            # weights, which the gather writes whole. Written in place first, it would be a slice of the
            # weights mutated, which functionalization makes a fresh copy of the whole weights (a 30m
            # block's 20 MB, read and written twice a step)
            if span is None or not gathering:
                master.copy_(new)
            if gathering:
                gathered_into(unit.params, new.to(unit.params.dtype), groups[unit.name])
            elif span is None:  # 16-bit weights: the master's new rounding
                unit.params.copy_(master)
