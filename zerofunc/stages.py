"""The four ZeRO stages as data: what each rank keeps sharded.

Everything else follows from these three flags (see engine.py):
- optimizer sharded: gradients are reduce-scattered, not all-reduced, and each rank
  updates only its shard; if parameters are kept whole, they are all-gathered after.
- gradients sharded: a unit's gradient is reduce-scattered the moment it exists and
  only the rank's shard is kept; otherwise the full local gradient is kept until the
  optimizer step.
- parameters sharded: a rank keeps only its shard of each unit and gathers the unit
  just before each use (forward and backward), releasing it after.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    level: int
    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool


STAGES = {
    0: Stage(0, shard_optimizer=False, shard_grads=False, shard_params=False),
    1: Stage(1, shard_optimizer=True, shard_grads=False, shard_params=False),
    2: Stage(2, shard_optimizer=True, shard_grads=True, shard_params=False),
    3: Stage(3, shard_optimizer=True, shard_grads=True, shard_params=True),
}


def get_stage(level: int) -> Stage:
    if level not in STAGES:
        raise ValueError(f"ZeRO stage must be one of 0, 1, 2, 3, got {level}")
    return STAGES[level]
