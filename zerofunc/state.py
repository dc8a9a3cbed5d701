"""What a training step changes besides the units' buffers, as values: an `OptimizerState` goes into a step
and a new one comes out (zerofunc/step.py: `step(engine, state, micro_batches) -> (state, metrics)`).

The units' buffers (the weights, the fp32 masters, AdamW's moments) are updated in place: a step donates
them, as a jitted function donates its input buffers, since a second copy of a model's optimizer state is
what ZeRO exists to avoid. Everything else a step changes is here, frozen: a step replaces it, never edits it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from zerofunc.loss_scale import LossScaler


@dataclass(frozen=True)
class OptimizerState:
    steps: int = 0                            # optimizer steps taken, skipped ones excluded: AdamW's t
    skipped: int = 0                          # fp16 boundaries whose gradients overflowed (the scale adapts)
    nonfinite: int = 0                        # fp32/bf16 boundaries whose gradients held an inf or a NaN
    grad_norm: float = math.nan               # the last boundary's global norm (unscaled, before clipping)
    loss_scale: Optional[LossScaler] = None   # fp16's loss scale (zerofunc/loss_scale.py)

    @property
    def loss_multiplier(self) -> float:
        """What backward multiplies the loss by: fp16's scale, else 1."""
        return self.loss_scale.scale if self.loss_scale is not None else 1.0


@dataclass(frozen=True)
class StepMetrics:
    loss: torch.Tensor   # the global batch's mean loss, a 0-dim tensor (reading it is the caller's host sync)
    grad_norm: float     # the step's global gradient norm, before clipping
    applied: bool        # whether the weights changed (not where the gradients were not finite)
