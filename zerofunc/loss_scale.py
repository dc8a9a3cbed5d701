"""Loss scaling for fp16 training, DeepSpeed style.

fp16 gradients underflow unless the loss is multiplied by a large factor before
backward; the optimizer then divides it out. With a dynamic scale, a step whose
gradients overflow (inf or nan on any rank) is skipped on every rank. The scale halves
after `hysteresis` overflows and doubles after `window` consecutive clean steps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
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

    def updated(self, overflow: bool) -> "LossScaler":
        """The scaler after one boundary step's outcome: the scale adapted."""
        if not self.dynamic:
            return self
        if overflow:
            if self.overflows + 1 >= self.hysteresis:
                return replace(self, scale=max(self.scale / 2, self.min_scale), overflows=0, clean_steps=0)
            return replace(self, overflows=self.overflows + 1, clean_steps=0)
        if self.clean_steps + 1 >= self.window:
            return replace(self, scale=self.scale * 2, clean_steps=0)
        return replace(self, clean_steps=self.clean_steps + 1)

    def state_dict(self) -> dict:
        return dict(vars(self))
