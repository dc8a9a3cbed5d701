"""The loss on held-out tokens: the engine's forward without backward, over the same windows every time.

Under stage 3 the forward gathers and releases each block as in training (the engine's hooks do
it), and nothing is left behind that the next training step would see: no gradient, no saved
tensor, no gathered block, the optimizer and the model's mode as they were. A run evaluated every
K steps trains bit for bit as one never evaluated (tests/test_evaluate.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from zerofunc.engine import ZeroEngine
from zerofunc.step import loss_of


@torch.no_grad()
def evaluate(engine: ZeroEngine, batches: Sequence[Sequence[torch.Tensor]]) -> float:
    """The mean loss over this rank's `batches` (positional model arguments, each of equal size on
    every rank, so the mean of the ranks' means is the global one); one scalar all-reduce."""
    if engine.micro_step:
        raise RuntimeError("evaluate() between micro-steps: the accumulated gradients would be mixed up")
    model = engine.model
    training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    try:
        for batch in batches:
            total += loss_of(engine(*batch)).float()
    finally:  # (the engine's forward releases what it gathered, a prefetch in vain included)
        model.train(training)
    mean = total / len(batches)
    engine.reduce_data_parallel(mean, tag="metrics")
    return mean.item()
