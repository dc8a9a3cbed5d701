"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupCosineLR, WarmupDecayLR), as a function of the step.

zerofunc.config reads the `scheduler` section into a `Schedule`; `SCHEDULES` lists each
kind's parameters, so an unknown one is an error there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SCHEDULES = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"},
    "WarmupDecayLR": {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
}


@dataclass(frozen=True)
class Schedule:
    """DeepSpeed's learning-rate schedules, as a function of the optimizer step (from 1)."""

    kind: str
    params: dict = field(default_factory=dict)

    def lr(self, step: int, base_lr: float) -> float:
        p = self.params
        warmup = p.get("warmup_num_steps", 1000)
        log_warmup = p.get("warmup_type", "log") == "log"
        t = step - 1  # DeepSpeed counts from 0

        def ramp() -> float:  # 0 -> 1 over the warm-up
            if warmup <= 0 or t >= warmup:
                return 1.0
            return math.log(t + 1) / math.log(warmup) if log_warmup else t / warmup

        if self.kind == "WarmupCosineLR":
            lo, total = p.get("warmup_min_ratio", 0.0), p["total_num_steps"]
            if t < warmup:
                return base_lr * (lo + (1 - lo) * ramp())
            progress = min(1.0, (t - warmup) / max(1, total - warmup))
            floor = p.get("cos_min_ratio", 1e-4)
            return base_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", base_lr)
        if self.kind == "WarmupLR" or t < warmup:
            return lo + (hi - lo) * ramp()
        total = p["total_num_steps"]  # WarmupDecayLR: linear to 0 at total_num_steps
        return hi * max(0.0, (total - t) / max(1.0, total - warmup))
