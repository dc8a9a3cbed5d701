"""The update at an accumulation boundary: unscale and clip, AdamW on fp32 masters, refresh the weights.

The engine decides how gradients are reduced into `unit.grad` (whole for stage 0, the
rank's shard otherwise); this is what happens to them once a boundary is reached. It
owns the optimizer's step count, the fp16 loss scaler and the learning-rate schedule,
which are what a checkpoint saves besides the units' masters and moments.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from zerofunc.comm import Communicator
from zerofunc.loss_scale import LossScaler
from zerofunc.optim import AdamWConfig, adamw_
from zerofunc.stages import Stage
from zerofunc.units import Unit


class ShardedAdamW:
    def __init__(self, units: list[Unit], stage: Stage, comm: Communicator, optim: AdamWConfig, memory,
                 clip: float = 0.0, loss_scaler: Optional[LossScaler] = None):
        self.units, self.stage, self.comm, self.optim, self.memory = units, stage, comm, optim, memory
        self.clip, self.loss_scaler = clip, loss_scaler
        self.step_count = 0          # optimizer steps taken (skipped ones excluded)
        self.skipped_steps = 0       # boundaries whose gradients overflowed
        self.lr_schedule: Optional[Callable[[int], float]] = None  # step (from 1) -> lr, when step() gets none

    @torch.no_grad()
    def step(self, lr: Optional[float] = None) -> bool:
        """AdamW on the fp32 master of what this rank owns, then refresh the weights the forward uses.

        Returns False, changing nothing, when fp16 gradients overflowed on any rank.
        """
        for unit in self.units:
            if unit.grad is None:
                raise RuntimeError(f"unit {unit.name or '<root>'} has no gradient: call backward() before step()")
        factor = self._unscale_and_clip()
        if factor is None:
            self._clear_grads()
            return False
        self.step_count += 1
        if lr is None and self.lr_schedule is not None:
            lr = self.lr_schedule(self.step_count)
        for unit in self.units:
            with self.memory.category("other"):
                grad = unit.grad.float() if factor == 1.0 else unit.grad.float().mul_(factor)
                adamw_(unit.master, grad, unit.m, unit.v, self.step_count, self.optim, lr=lr)
            self._refresh(unit, tag="params.step")
        self._clear_grads()
        return True

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Make the weights the forward uses match the fp32 masters (after loading a checkpoint)."""
        for unit in self.units:
            self._refresh(unit, tag="params.load")

    def _refresh(self, unit: Unit, tag: str) -> None:
        if self.stage.shard_optimizer and not self.stage.shard_params:
            # Whole weights from every rank's shard. A fresh input even in fp32: not
            # every backend gathers from a slice of its own output in place.
            with self.memory.category("buffers"):
                send = unit.master.to(unit.params.dtype, copy=True)
            self.comm.all_gather(unit.params, send, tag=tag)
        elif unit.master.dtype != unit.params.dtype:  # 16-bit stages 0 and 3: same span, new rounding
            unit.params.copy_(unit.master)

    def _unscale_and_clip(self) -> Optional[float]:
        """What to multiply the gradients by: 1 / loss scale, times the clip coefficient.

        Both need the global gradient norm, which costs one scalar all-reduce when the
        gradients are sharded (stage 0's are whole on every rank). A non-finite norm is
        an fp16 overflow: None, and the scale adapts.
        """
        scaler = self.loss_scaler
        if scaler is None and not self.clip:
            return 1.0
        device = self.units[0].master.device
        sq = torch.zeros(1, device=device, dtype=torch.float32)
        for unit in self.units:  # in fp32, without a full fp32 copy of a 16-bit gradient
            sq += torch.linalg.vector_norm(unit.grad, dtype=torch.float32).square()
        if self.stage.shard_optimizer:
            self.comm.all_reduce(sq, tag="grad_norm", mean=False)
        norm = sq.sqrt().item() if device.type != "meta" else 0.0
        factor = 1.0
        if scaler is not None:
            overflow = not math.isfinite(norm)
            scale = scaler.scale
            scaler.update(overflow)
            if overflow:
                self.skipped_steps += 1
                return None
            factor, norm = 1.0 / scale, norm / scale
        if self.clip:  # as torch.nn.utils.clip_grad_norm_
            factor *= min(1.0, self.clip / (norm + 1e-6))
        return factor

    def _clear_grads(self) -> None:
        for unit in self.units:
            unit.grad = unit.local_grad = None
