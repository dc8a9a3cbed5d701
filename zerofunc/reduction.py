"""A unit's gradient of one micro-step, accumulated and reduced as the stage says.

The engine hands each unit's gradient here as a value, the moment backward is done with the
unit (zerofunc/engine.py). Stages 0-1 keep the full local gradient as the accumulator and
communicate on the last micro-step only (the accumulation boundary); stages 2-3 reduce-scatter
every micro-step into the rank's shard. Hybrid sharding then averages the shard over the
replicas, once a step; optimizer offload takes it down to the host once it is reduced for the
last time. Reductions run behind the rest of backward, within the bucket size (`InFlight`).
"""
from __future__ import annotations

from typing import Optional

import torch

from zerofunc.collectives import all_reduce_gradient, average_over_replicas, reduce_scatter_gradient
from zerofunc.comm import Communicator
from zerofunc.layout import shard
from zerofunc.offload import OptimizerOffload
from zerofunc.overlap import InFlight
from zerofunc.stages import Stage
from zerofunc.units import Unit, reduced_dtype


class GradientReduction:
    """One engine's gradient reductions: `add` launches a unit's, `drain` finishes all in flight."""

    def __init__(self, stage: Stage, comm: Communicator, replicas: Optional[Communicator],
                 offload: Optional[OptimizerOffload], memory, reduce_dtype: torch.dtype, bucket_bytes: int):
        self.stage, self.comm, self.replicas, self.offload, self.memory = stage, comm, replicas, offload, memory
        self.reduce_dtype = reduce_dtype
        self._reducing = InFlight(bucket_bytes)

    def add(self, unit: Unit, grad: torch.Tensor, boundary: bool) -> None:
        """The unit's local gradient of this micro-step exists: accumulate and reduce it as the stage says.

        Stages 0-1 keep the full local gradient as the accumulator and communicate only
        on the last micro-step; stages 2-3 reduce-scatter every micro-step into a shard.
        Each reduction is launched here and finished (its result put in place) when the
        in-flight queue waits for it: later, while autograd works on earlier blocks.
        """
        dtype = reduced_dtype(grad.dtype, self.reduce_dtype)  # accumulated and reduced in it from here on
        if grad.dtype != dtype:
            grad = grad.to(dtype)
        if self.stage.shard_grads:
            self._scatter(unit, grad, boundary)
            return
        self.memory.track(grad, "grads")
        unit.local_grad = grad if unit.local_grad is None else unit.local_grad.add_(grad)
        if boundary:
            self._reduce_accumulated(unit)

    def left_out(self, unit: Unit) -> None:
        """The accumulation boundary's backward did not reach `unit` (the forward did not run it, on every rank
        alike): reduce what the step's earlier micro-steps accumulated (stages 0-1), or, where none reached it
        either, give it a zero gradient, as DeepSpeed's `ignore_unused_parameters` does; no collective for zeros."""
        if unit.local_grad is not None:
            self._reduce_accumulated(unit)
        elif unit.grad is not None:  # stages 2-3: reduce-scattered at an earlier micro-step
            self._reduced_for_the_step(unit)
        else:
            sharded = self.stage.shard_optimizer
            with self.memory.category("grads"):
                unit.grad = torch.zeros(unit.layout.shard_numel if sharded else unit.layout.padded_numel,
                                        dtype=reduced_dtype(unit.params.dtype, self.reduce_dtype),
                                        device=unit.params.device)
            if self.offload is not None:
                self._to_host(unit)

    def _reduce_accumulated(self, unit: Unit) -> None:
        """Stages 0-1 at the boundary: the step's accumulated local gradient, all-reduced (stage 0) or reduced
        onto this rank's slice of it (stage 1)."""
        if self.stage.shard_optimizer:
            self._scatter(unit, unit.local_grad, True)
            return
        unit.grad = unit.local_grad
        nbytes = unit.grad.numel() * unit.grad.element_size()
        self._reducing.add(all_reduce_gradient(self.comm, unit.grad, async_op=self._reducing.overlaps(nbytes)), nbytes)

    def _scatter(self, unit: Unit, sent: torch.Tensor, boundary: bool) -> None:
        """Reduce-scatter `sent` (stages 2-3: this micro-step's, into the shard; stage 1: the accumulated
        gradient, onto its own slice)."""
        stage, comm = self.stage, self.comm
        nbytes = sent.numel() * sent.element_size()
        overlapped = self._reducing.overlaps(nbytes)
        self.memory.track(sent, "buffers" if stage.shard_grads else "grads")  # 2-3: only sent; 1: the gradient kept
        reduced = None  # ZeRO-1 keeps the full gradient: the reduced shard lands in its own slice
        if stage.shard_grads:
            with self.memory.category("grads"):
                reduced = torch.empty(unit.layout.shard_numel, device=sent.device, dtype=sent.dtype)

        def done():  # `sent` stays referenced, so allocated, until the reduce-scatter has finished with it
            if not stage.shard_grads:
                unit.grad = shard(sent, comm.rank, comm.world_size)
            else:
                unit.grad = reduced if unit.grad is None else unit.grad.add_(reduced)
            if boundary:
                self._reduced_for_the_step(unit)

        self._reducing.add(reduce_scatter_gradient(comm, reduced, sent, async_op=overlapped), nbytes, done)

    def _reduced_for_the_step(self, unit: Unit) -> None:
        """The unit's gradient shard is reduced over the shard group for the last time this step: hybrid sharding
        averages it over the replicas, in flight behind the rest of backward; optimizer offload then takes it
        down to the host."""
        then = (lambda: self._to_host(unit)) if self.offload is not None else None
        if self.replicas is not None:
            shard_bytes = unit.grad.numel() * unit.grad.element_size()
            self._reducing.add(average_over_replicas(self.replicas, unit.grad, async_op=
                                                     self._reducing.overlaps(shard_bytes)), shard_bytes, then)
        elif then is not None:
            then()

    def _to_host(self, unit: Unit) -> None:
        unit.grad = self.offload.gradient_down(unit.staging, unit.grad)

    def drain(self) -> None:
        """Wait for every reduction in flight, in launch order (the same on every rank)."""
        self._reducing.drain()
