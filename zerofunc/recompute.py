"""Activation checkpointing: a block keeps only its inputs, and recomputes its forward in backward.

`ActivationCheckpointing` says which blocks (the stage-3 gather units, for any model):
- "none": every block keeps its activations (the default);
- "full": every block recomputes;
- "selective": every `every`-th block recomputes (the first, then every `every`-th after it),
  torchtitan's layer-selective mode. The alternative, saving some ops' outputs inside every
  block (torchtitan's op-selective mode, or Megatron's), needs to know the model's ops: which
  call is the attention, which matmuls are worth keeping. A block is the one thing zerofunc
  knows about every model it accepts, so selection is by block, and `every` is one number
  the planner can search.

The mechanism is torch's non-reentrant `torch.utils.checkpoint`: the forward saves nothing
inside the block, and the first time backward needs one of its tensors the block runs
again, tensor for tensor, under the same RNG state (so dropout draws the same masks; our
models seed dropout by sample and need no RNG state at all). Autograd still walks the
original graph, so each unit's gradient reaches the engine exactly as without
checkpointing, and training is bit for bit the same in fp32.

The output head is not a block, but it keeps the largest activations of all: the logits and
their softmax, vocabulary-wide per token. A model whose loss is `zerofunc.lm_head.LinearCrossEntropy`
(zerofunc's GPT-2 and Llama are) recomputes its logits chunk by chunk whenever checkpointing is
on, full or selective; other models keep their head as they compute it.

A recomputed block's weights must be bound again (the engine binds a block's views only
while its forward runs), and under stage 3 gathered again: the engine's `recompute`
callback does both, marks the time in the memory timeline, and leaves the unit gathered
for the backward that follows, which releases it.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class ActivationCheckpointing:
    mode: str = "none"
    every: int = 2  # selective: one block in `every` recomputes

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"activation checkpointing every K blocks needs K >= 1, got {self.every}")

    @property
    def on(self) -> bool:
        return self.mode != "none"

    def recomputes(self, block: int) -> bool:
        """Whether block number `block` (from 0, in forward order) is checkpointed."""
        return self.mode == "full" or (self.mode == "selective" and block % self.every == 0)

    def describe(self) -> str:
        return {"none": "none", "full": "full"}.get(self.mode, f"every {self.every}")


def checkpointed(forward: Callable, in_forward: Callable[[], bool], recompute: Callable[[], contextlib.AbstractContextManager]):
    """`forward` run under non-reentrant checkpointing.

    `in_forward()` tells the first run (the engine has bound the block's weights) from the
    recomputation in backward, which runs inside `recompute()`: the engine's context that
    gathers and binds the weights again. The RNG state is restored for the recomputation
    except on the meta device, which has none.
    """
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        meta = any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in (*args, *kwargs.values()))
        modes = _get_current_function_mode_stack()

        def run_block(*args, **kwargs):
            if in_forward():
                return forward(*args, **kwargs)
            with recompute(), contextlib.ExitStack() as stack:
                # the forward's function modes, as checkpoint restores its autocast state: a mode
                # is off while its own handler runs, and backward may have been called from one
                active = _get_current_function_mode_stack()
                for mode in modes:
                    if all(mode is not m for m in active):
                        stack.enter_context(mode)
                return forward(*args, **kwargs)

        return checkpoint(run_block, *args, use_reentrant=False, preserve_rng_state=not meta, **kwargs)
    return wrapper
