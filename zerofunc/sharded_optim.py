"""The update at an accumulation boundary: unscale and clip, AdamW on fp32 masters, refresh the weights.

The engine decides how gradients are reduced into `unit.grad` (whole for stage 0, the
rank's shard otherwise); this is what happens to them once a boundary is reached. What
the update changes besides the units' buffers (the step count, the fp16 loss scale, the
counts of skipped steps, the norm) is a value: `step(state) -> state` (zerofunc/state.py),
which a checkpoint saves besides the units' masters and moments.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Callable, Optional

import torch

from sim.placement import placed
from zerofunc.collectives import gather_weights, sum_over_ranks
from zerofunc.comm import Communicator
from zerofunc.fused import adamw_fused_, unscale_
from zerofunc.optim import AdamWConfig
from zerofunc.overlap import InFlight
from zerofunc.stages import Stage
from zerofunc.state import OptimizerState
from zerofunc.units import Unit


class ShardedAdamW:
    def __init__(self, units: list[Unit], stage: Stage, comm: Communicator, optim: AdamWConfig, memory,
                 clip: float = 0.0, bucket_bytes: int = 0, offload=None):
        self.units, self.stage, self.comm, self.optim, self.memory = units, stage, comm, optim, memory
        self.offload = offload  # a zerofunc.offload.OptimizerOffload: the update runs on the host
        self._gathering = InFlight(bucket_bytes)  # stages 1-2: new weights spreading while the next unit updates
        self.clip = clip
        self.lr_schedule: Optional[Callable[[int], float]] = None  # step (from 1) -> lr, when step() gets none

    @torch.no_grad()
    def step(self, state: OptimizerState, lr: Optional[float] = None) -> OptimizerState:
        """AdamW on the fp32 master of what this rank owns, then refresh the weights the forward uses;
        the state after it.

        Changes no weight, counting the step as skipped (fp16: the loss scale adapts) or non-finite,
        when any rank's gradients hold an inf or a NaN: an fp16 overflow, or in fp32 and bf16 a
        diverged step, whose update would carry the NaN into every weight.
        """
        for unit in self.units:
            if unit.grad is None:
                raise RuntimeError(f"unit {unit.name or '<root>'} has no gradient: call backward() before step()")
        if self.offload is not None:
            self.offload.wait()
        state, factor = self._unscale_and_clip(state)
        if factor is None:
            self._clear_grads()
            return state
        if lr is None and self.lr_schedule is not None:
            lr = self.lr_schedule(state.steps)
        for unit in self.units:
            self._update(unit, lr, factor, state.steps)
        self._gathering.drain()
        self._clear_grads()
        return state

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Make the weights the forward uses match the fp32 masters (after loading a checkpoint)."""
        for unit in self.units:
            self._refresh(unit)

    def _refresh(self, unit: Unit) -> None:
        out, gather = self._weights_out(unit)
        if out is not None:
            out.copy_(unit.master)
        if gather:
            gather_weights(self.comm, unit.params, out, "params.load")

    def _update(self, unit: Unit, lr: Optional[float], factor: float, t: int) -> None:
        """AdamW on one unit's master; the same pass writes the weights' new rounding or the send buffer.

        A method of its own (as `_refresh`) so that the send buffer dies on return, before
        the next unit allocates its own.
        """
        out, gather = self._weights_out(unit)
        with self.memory.category("other"):
            if self.offload is not None:
                self.offload.update(unit.master, unit.grad, unit.m, unit.v, t, self.optim, lr, factor, out)
            else:
                adamw_fused_(unit.master, unit.grad, unit.m, unit.v, t, self.optim, lr=lr,
                             grad_scale=factor, out=out)
        if gather:  # runs behind the next unit's update, within the bucket size
            nbytes = unit.params.numel() * unit.params.element_size()
            handle = gather_weights(self.comm, unit.params, out, "params.step", async_op=self._gathering.overlaps(nbytes))
            self._gathering.add(handle, nbytes, holds=(out,))

    def _weights_out(self, unit: Unit) -> tuple[Optional[torch.Tensor], bool]:
        """Where the master's new values go besides the master, and whether that is then all-gathered.

        Stages 1-2: into a send buffer of this rank's shard, which the all-gather spreads
        into every rank's whole weights; a fresh buffer even in fp32, as not every backend
        gathers from a slice of its own output in place. 16-bit stages 0 and 3: the weights
        are the same span as the master, rounded. fp32 stages 0 and 3: the master is the
        weights, nothing to write, unless it is offloaded to the host.
        """
        if self.stage.shard_optimizer and not self.stage.shard_params:
            with self.memory.category("buffers"):
                send = torch.empty(unit.master.shape, device=unit.params.device, dtype=unit.params.dtype)
            return send, True
        if unit.master.dtype != unit.params.dtype or self.offload is not None:
            return unit.params, False
        return None, False

    def _unscale_and_clip(self, state: OptimizerState) -> tuple[OptimizerState, Optional[float]]:
        """The state with the step's norm (and fp16's scale adapted), and what to multiply the gradients
        by: 1 / loss scale, times the clip coefficient.

        Both need the global gradient norm, which costs one small all-reduce when the
        gradients are sharded (stage 0's are whole on every rank). With fp16 loss scaling
        it reduces [sum of squares, found_inf] of the unscaled gradients, both from one
        pass of `unscale_` per unit; any non-finite value is an overflow: None, and the
        scale adapts. Without it the norm is taken anyway, one read of the gradient shard,
        as DeepSpeed does: a non-finite norm means a non-finite gradient, and the step is
        skipped (None) rather than written into the weights.

        The unscaled fp32 gradients are not kept: all units' at once would add 4 bytes
        per gradient element to the step's peak, which otherwise holds one unit's
        temporaries at a time. So this pass writes nothing, and AdamW reads the 16-bit
        gradient again and multiplies it by the returned factor as it loads it.
        """
        scaler = state.loss_scale
        device = self.units[0].params.device  # where the collective runs; offloaded gradients are on the host
        stats = torch.zeros(2 if scaler is not None else 1, device=device, dtype=torch.float32)
        with placed("host") if self.offload is not None else contextlib.nullcontext():
            for unit in self.units:  # [sum of squares, found_inf], or the sum of squares in fp32
                local = (torch.cat(unscale_(unit.grad, 1.0 / scaler.scale)) if scaler is not None
                         else torch.linalg.vector_norm(unit.grad, dtype=torch.float32).square().reshape(1))
                stats += local.to(device)
        if self.stage.shard_optimizer:
            sum_over_ranks(self.comm, stats)
        stats[0:1].sqrt_()  # the norm, in fp32 as before
        norm, found_inf = (stats.tolist() + [0.0])[:2] if device.type != "meta" else (0.0, 0.0)
        return self.decide(state, norm, found_inf)

    def decide(self, state: OptimizerState, norm: float,
               found_inf: float = 0.0) -> tuple[OptimizerState, Optional[float]]:
        """What a boundary's global norm (of the unscaled gradients) decides, for this step and the step
        compiled whole alike: the state after it (the norm logged, fp16's scale adapted, the step counted
        as taken, skipped or non-finite) and the factor the gradients are multiplied by (1 / loss scale
        times the clip coefficient), None where the step is not taken."""
        scaler = state.loss_scale
        state = replace(state, grad_norm=norm)  # of the step's (unscaled, unclipped) gradients, for the log
        factor = 1.0
        if scaler is not None:
            overflow = found_inf > 0 or not math.isfinite(norm)
            state = replace(state, loss_scale=scaler.updated(overflow))
            if overflow:
                return replace(state, skipped=state.skipped + 1), None
            factor = 1.0 / scaler.scale
        elif not math.isfinite(norm):
            return replace(state, nonfinite=state.nonfinite + 1), None
        if self.clip:  # as torch.nn.utils.clip_grad_norm_
            factor *= min(1.0, self.clip / (norm + 1e-6))
        return replace(state, steps=state.steps + 1), factor

    def _clear_grads(self) -> None:
        for unit in self.units:
            unit.grad = unit.local_grad = None
