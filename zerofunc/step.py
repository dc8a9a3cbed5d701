"""The training step, shared by the trainer (real tensors) and the planner (meta tensors)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from zerofunc.engine import ZeroEngine

MicroBatch = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def loss_of(out: Any) -> torch.Tensor:
    """The loss a forward returned: the tensor itself, or a Hugging Face output's `.loss`."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError(f"the model returned {type(out).__name__} without a loss; give it targets (labels=)")
    return loss


def train_step(engine: ZeroEngine, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; the loss averaged over the global batch.

    A micro-batch is the model's positional arguments (our models: inputs, targets),
    or its keyword arguments (a Hugging Face model: input_ids=, labels=).

    With equal micro-batches everywhere, the mean of the micro-steps' mean losses,
    averaged over ranks, is the mean over the global batch. It costs one scalar
    all-reduce, tagged "metrics".
    """
    if len(micro_batches) != engine.grad_accum:
        raise ValueError(f"{len(micro_batches)} micro-batches for {engine.grad_accum} accumulation steps")
    total = None
    for batch in micro_batches:
        loss = loss_of(engine(**batch) if isinstance(batch, Mapping) else engine(*batch))
        engine.backward(loss)
        total = loss.detach().float() if total is None else total + loss.detach().float()
    engine.step()
    mean = total / len(micro_batches)
    engine.comm.all_reduce(mean, tag="metrics")
    return mean
