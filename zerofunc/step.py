"""The training step, shared by the trainer (real tensors) and the planner (meta tensors)."""
from __future__ import annotations

import torch

from zerofunc.engine import ZeroEngine


def train_step(engine: ZeroEngine, *batch: torch.Tensor) -> torch.Tensor:
    """One optimizer step on this rank's batch; the loss averaged over all ranks.

    With equal micro-batches on every rank the average of the ranks' mean losses is the
    mean over the global batch. It costs one scalar all-reduce, tagged "metrics".
    """
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    engine.comm.all_reduce(mean, tag="metrics")
    return mean
