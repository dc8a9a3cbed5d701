"""AdamW as a stateless function over flat fp32 buffers.

All state (m, v, the step count) is passed in, nothing is hidden in an object, so the
same call updates a full buffer (stage 0) or one rank's shard (stages 1-3): Adam is
element-wise, and an element's update depends only on that element. The arithmetic
follows torch.optim.AdamW's single-tensor path operation for operation, so the two
agree to rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"learning rate must be >= 0, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")


@torch.no_grad()
def adamw_(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
           step: int, cfg: AdamWConfig, lr: float | None = None) -> None:
    """One AdamW update of `param`, `m` and `v` in place; `step` counts from 1.

    Decoupled weight decay (the parameter shrinks by lr*wd before the Adam step) and
    bias correction by `step`. `lr` overrides `cfg.lr` for schedules.
    """
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    lr = cfg.lr if lr is None else lr
    beta1, beta2 = cfg.betas
    param.mul_(1 - lr * cfg.weight_decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(cfg.eps)
    param.addcdiv_(m, denom, value=-step_size)
