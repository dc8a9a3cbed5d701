"""The training step, shared by the trainer (real tensors) and the planner (meta tensors).

The loss is a mean over the global batch's counted tokens: every target of every
micro-batch of every rank that is not IGNORE_INDEX (-100: padding, a masked prompt).
Each micro-batch's own token mean would weigh a token by how few others share its
micro-batch, so with ignored labels N ranks would no longer train like one device.
Hugging Face's convention carries the global count to the model: a forward that takes
`num_items_in_batch` returns (sum of its token losses) / num_items_in_batch (their
`ForCausalLMLoss`; our GPT and Llama likewise). `train_step` counts this rank's targets,
all-reduces that one count and passes each micro-step

    num_items_in_batch = global count / (world_size * grad_accum)

The engine divides each micro-step's loss by grad_accum in backward and the stages
average gradients over ranks, so the step's gradient is that of (sum over the global
batch) / (global count), as torchtitan's `global_valid_tokens` makes it. With no ignored
labels and equal micro-batches that normalizer is each micro-batch's own count, exactly,
and nothing changes.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from zerofunc.engine import ZeroEngine
from zerofunc.lm_head import IGNORE_INDEX
from zerofunc.state import OptimizerState, StepMetrics

MicroBatch = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def loss_of(out: Any) -> torch.Tensor:
    """The loss a forward returned: the tensor itself, or a Hugging Face output's `.loss`."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError(f"the model returned {type(out).__name__} without a loss; give it targets (labels=)")
    return loss


def takes_num_items(model: nn.Module) -> bool:
    """Whether the model's forward takes `num_items_in_batch`, as Hugging Face's Trainer decides it: the
    model's `accepts_loss_kwargs` where it says (a Hugging Face model whose **kwargs do not reach its loss
    says False), else a parameter of that name or **kwargs (Hugging Face's causal LMs hand their **kwargs to
    the loss). Any other model gets no keyword, and its loss stays whatever its forward computes (for a
    token mean: the micro-batch's own)."""
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is not None:
        return bool(accepts)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "num_items_in_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss shifts `labels` by one, so that their first position is never a target: a
    causal LM's (Hugging Face's ForCausalLMLoss, also the loss of a model that names none). Not an
    encoder-decoder's, whose decoder reads the labels shifted right so that every label is a target (T5,
    BART, T5Gemma), nor a masked LM's: Hugging Face's Trainer counts their labels as they are."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None:
        return True
    try:  # a loss_type: a Hugging Face model's, which names its loss in transformers' mapping
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return True
    return LOSS_MAPPING.get(loss_type, ForCausalLMLoss) is ForCausalLMLoss


def counted_targets(batch: MicroBatch, shifted: bool = True) -> Optional[torch.Tensor]:
    """How many targets of a micro-batch the loss counts (an int64 tensor; no host sync), or None
    when it carries no integer targets.

    Positional (our models: inputs, targets): the targets not IGNORE_INDEX. Keyword (Hugging Face):
    `labels[..., 1:]` not IGNORE_INDEX where the loss is `shifted` (a causal LM's shifts the labels by
    one and pads the last position with IGNORE_INDEX: `shifts_labels`), else all of `labels`;
    `shift_labels`, when given, are taken as they are.
    """
    if isinstance(batch, Mapping):
        if batch.get("shift_labels") is not None:
            targets = batch["shift_labels"]
        elif batch.get("labels") is not None:
            targets = batch["labels"][..., 1:] if shifted else batch["labels"]
        else:
            return None
    elif len(batch) > 1 and isinstance(batch[1], torch.Tensor):
        targets = batch[1]
    else:
        return None
    if targets.is_floating_point() or targets.is_complex():  # a regression target: nothing to count
        return None
    return (targets != IGNORE_INDEX).sum()


def num_items_in_batch(engine: ZeroEngine, micro_batches: Sequence[MicroBatch]) -> Optional[torch.Tensor]:
    """The global batch's counted targets / (world_size * grad_accum), as an fp32 scalar tensor: what
    each of this rank's micro-steps divides its summed loss by. One all-reduce of this rank's count
    (8 bytes, tagged "tokens"); no host sync, so it runs on meta tensors too.

    None, and no collective, when the model's forward does not take the keyword or the micro-batches
    carry no integer targets. A global batch with no counted target is taken to count 1: its loss is
    0 and its gradients are zero, not NaN (the step still applies AdamW's momentum and weight decay,
    as a step of zero gradients does).

    Every rank must call it with its micro-batches of the same step: the count is a collective.
    A DeepSpeed-style loop gets the global mean by passing it to each micro-step's forward:
    `engine(*batch, num_items_in_batch=n)`; `train_step` does so.
    """
    if not micro_batches or not takes_num_items(engine.model):
        return None
    shifted = shifts_labels(engine.model)
    counts = [counted_targets(b, shifted) for b in micro_batches]
    if any(c is None for c in counts):
        return None
    count = torch.stack(counts).sum() if len(counts) > 1 else counts[0]
    engine.reduce_data_parallel(count, tag="tokens", mean=False)
    return count.clamp_min(1).float() / (engine.data_parallel_size * engine.grad_accum)


def micro_step_loss(engine: ZeroEngine, batch: MicroBatch, num_items: Optional[torch.Tensor]) -> torch.Tensor:
    """The loss of one micro-batch through the engine, normalized by `num_items` when given."""
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    return loss_of(engine(**batch, **extra) if isinstance(batch, Mapping) else engine(*batch, **extra))


def step(engine: ZeroEngine, state: OptimizerState,
         micro_batches: Sequence[MicroBatch]) -> tuple[OptimizerState, StepMetrics]:
    """One optimizer step over this rank's micro-batches: `state` in (zerofunc/state.py), the state after
    the step out, and the step's metrics; the loss averaged over the global batch.

    A micro-batch is the model's positional arguments (our models: inputs, targets),
    or its keyword arguments (a Hugging Face model: input_ids=, labels=).

    The loss is the global batch's token mean (see the module's docstring): each micro-step's
    loss is its summed token loss / num_items_in_batch, and their mean over micro-steps and
    ranks is the sum over the global batch / its count. A model that does not take the
    keyword keeps its own loss, and the logged loss is then the mean of the micro-steps'.
    Besides the count's all-reduce, the logged loss costs one scalar all-reduce, tagged "metrics".

    The engine's units' buffers are updated in place (donated: zerofunc/state.py); nothing else of
    the engine changes. Every rank calls it with its own micro-batches of the same step.
    """
    if len(micro_batches) != engine.grad_accum:
        raise ValueError(f"{len(micro_batches)} micro-batches for {engine.grad_accum} accumulation steps")
    num_items = num_items_in_batch(engine, micro_batches)
    if engine.whole is not None:  # the step compiled whole (zerofunc/whole_step.py)
        after, mean = engine.whole(state, micro_batches, num_items)
    else:
        scale = state.loss_multiplier / len(micro_batches)
        total = None
        for i, batch in enumerate(micro_batches):
            loss = micro_step_loss(engine, batch, num_items)
            engine.differentiate(loss, scale, boundary=i == len(micro_batches) - 1)
            total = loss.detach().float() if total is None else total + loss.detach().float()
        after = engine.update(state)
        mean = total / len(micro_batches)
    engine.reduce_data_parallel(mean, tag="metrics")
    return after, StepMetrics(mean, after.grad_norm, applied=after.steps > state.steps)


def train_step(engine: ZeroEngine, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
    """`step` on the engine's own state (`engine.state`, the imperative API's), which it replaces; the
    global batch's mean loss."""
    if engine.micro_step:
        raise RuntimeError(f"train_step with {engine.micro_step} micro-step(s) of engine.backward() not yet stepped")
    engine.state, metrics = step(engine, engine.state, micro_batches)
    return metrics.loss
