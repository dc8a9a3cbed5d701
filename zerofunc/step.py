"""The training step, shared by the trainer (real tensors) and the planner (meta tensors)."""
from __future__ import annotations

from typing import Sequence

import torch

from zerofunc.engine import ZeroEngine


def train_step(engine: ZeroEngine, micro_batches: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; the loss averaged over the global batch.

    With equal micro-batches everywhere, the mean of the micro-steps' mean losses,
    averaged over ranks, is the mean over the global batch. It costs one scalar
    all-reduce, tagged "metrics".
    """
    if len(micro_batches) != engine.grad_accum:
        raise ValueError(f"{len(micro_batches)} micro-batches for {engine.grad_accum} accumulation steps")
    total = None
    for batch in micro_batches:
        loss = engine(*batch)
        engine.backward(loss)
        total = loss.detach().float() if total is None else total + loss.detach().float()
    engine.step()
    mean = total / len(micro_batches)
    engine.comm.all_reduce(mean, tag="metrics")
    return mean
