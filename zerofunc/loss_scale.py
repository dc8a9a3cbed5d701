"""Loss scaling for fp16 training, DeepSpeed style.

fp16 gradients underflow unless the loss is multiplied by a large factor before
backward; the optimizer then divides it out. With a dynamic scale, a step whose
gradients overflow (inf or nan on any rank) is skipped on every rank. The scale halves
after `hysteresis` overflows and doubles after `window` consecutive clean steps.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0**16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    overflows: int = 0      # overflows since the scale last changed
    clean_steps: int = 0    # clean steps since the last overflow or growth

    def __post_init__(self) -> None:
        if not self.scale > 0 or self.window < 1 or self.hysteresis < 1 or not self.min_scale > 0:
            raise ValueError(f"invalid loss scaling: {self}")

    def update(self, overflow: bool) -> None:
        """Record one boundary step's outcome and adapt the scale."""
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            self.overflows += 1
            if self.overflows >= self.hysteresis:
                self.scale = max(self.scale / 2, self.min_scale)
                self.overflows = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= 2
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return dict(vars(self))
