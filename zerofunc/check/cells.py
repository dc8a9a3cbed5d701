"""One cell of the check: a plan simulated on meta tensors, and the same step run for real in a simulated world.

The real side is the trainer's: `zerofunc.initialize` with the config the plan
describes, `train_step` on a batch of that shape, the project's `DistCommunicator`
over a fake process group of the plan's world size (see world.py). Measured means:
- on CPU, the planner's own memory tracker on the real tensors, as `python -m train`
  reports it;
- on CUDA, `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, with
  `memory_reserved` beside it and the tracker's count of one more step, which tells
  the allocator's share (rounding, workspaces) from the step's own tensors.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from sim.memory import MemoryTracker
from zerofunc.api import initialize
from zerofunc.check.world import simulated_world, twin_groups
from zerofunc.lora import WithAdapters
from zerofunc.plan import Plan, simulate
from zerofunc.step import train_step


@dataclass
class Cell:
    stage: int
    world_size: int
    shard_group: int                 # ranks per shard group (the world's size: no hybrid sharding)
    planned_peak: int
    measured_peak: int
    planned_comm: int                # bytes of one step, counted as the ZeRO paper does
    measured_comm: int
    ledger_equal: bool               # every collective the same: op, dtype, bytes, group, tag, overlap
    planned_step_s: float            # roofline compute + the communication it does not hide
    planned_compute_s: float
    losses: list[float] = field(default_factory=list)
    measured_step_s: Optional[float] = None  # CUDA: median of the measured steps (the fake group moves no data)
    reserved: Optional[int] = None           # CUDA: the caching allocator's reserve at the end
    reserved_peak: Optional[int] = None      # CUDA: its largest reserve during the measured steps (what torchtitan logs)
    tracked_peak: Optional[int] = None       # CUDA: the memory tracker's peak of one more step
    requested_peak: Optional[int] = None     # CUDA: the allocator's peak of bytes asked for, before its rounding
    held_before: Optional[int] = None        # CUDA: bytes allocated when the cell began (kept by earlier work)

    @property
    def peak_ratio(self) -> float:
        return self.planned_peak / self.measured_peak

    def failures(self, tolerance: float) -> list[str]:
        """What disagrees, one phrase each; empty when the plan holds."""
        out = []
        if not self.ledger_equal:
            out.append(f"communication planned {self.planned_comm:,} B, executed {self.measured_comm:,} B"
                       if self.planned_comm != self.measured_comm else "the collectives differ (same bytes)")
        if abs(self.peak_ratio - 1) > tolerance:
            out.append(f"peak planned/measured {self.peak_ratio:.4f}, outside {tolerance:.0%}")
        if not all(math.isfinite(x) for x in self.losses):
            out.append(f"non-finite loss {self.losses}")
        return out

    def as_json(self) -> dict:
        return asdict(self) | {"peak_ratio": self.peak_ratio}


def sample_batch(plan: Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens of the plan's shape (their values do not change memory or communication)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, plan.config.vocab_size, (plan.micro_batch, plan.tokens + 1), generator=g)
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def run_cell(plan: Plan, device: torch.device, compile: bool = False, steps: int = 2) -> Cell:
    """Simulate `plan`, then run `steps` real steps of it as rank 0 of its world on `device`.

    The peak is the largest over the steps and every step's ledger must equal the plan's.
    On CUDA a first, unmeasured step warms up (compilation, cuBLAS's workspace).
    """
    sim = simulate(plan)
    if device.type == "cuda":
        gc.collect()  # an engine is a web of hooks and closures: the last cell's memory goes only with its cycles
        torch.cuda.empty_cache()  # the cell starts from an empty reserve
    held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    with simulated_world(plan.world_size, device) as comm:
        comm, replicas = twin_groups(comm, plan.hybrid_group) if plan.hybrid_group else (comm, None)
        cell = _measure(plan, sim, comm, replicas, device, compile, steps)
    cell.held_before = held_before
    return cell


def _measure(plan: Plan, sim, comm, replicas, device: torch.device, compile: bool, steps: int) -> Cell:
    cuda = device.type == "cuda"
    model = plan.build()  # the plan's model on meta, with --lora its adapters
    init = lambda name, shape: model.init_param(name, shape, 0)  # noqa: E731
    if plan.lora is not None:
        init = WithAdapters(init, 0)
    tracker = MemoryTracker(workspaces=plan.profile.matmul_workspace)  # the device's, as the plan counts them
    engine = initialize(model, plan.zero_config(), device=device, comm=comm, replicas=replicas, memory=tracker,
                        compile=compile, init=init)
    batch = [sample_batch(plan, device)]
    peaks, times, losses, equal, executed, requested, reserved_peak = [], [], [], True, 0, 0, 0
    if cuda:
        train_step(engine, batch)
        torch.cuda.synchronize(device)
    for _ in range(steps):
        comm.ledger.clear()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            loss = train_step(engine, batch)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated(device))
            stats = torch.cuda.memory_stats(device)
            requested = max(requested, stats.get("requested_bytes.all.peak", 0))
            reserved_peak = max(reserved_peak, stats.get("reserved_bytes.all.peak", 0))
        else:
            tracker.reset_peak()
            with tracker:
                loss = train_step(engine, batch)
            peaks.append(tracker.peak)
        losses.append(loss.item())
        equal &= comm.ledger.entries == sim.ledger
        executed = max(executed, comm.ledger.volume_bytes())
    cell = Cell(plan.stage, plan.world_size, plan.hybrid_group or plan.world_size, sim.memory.peak, max(peaks),
                sim.volume_bytes, executed, equal, sim.step_s, sim.compute_s, losses)
    if cuda:
        cell.measured_step_s = statistics.median(times)
        cell.reserved = torch.cuda.memory_reserved(device)
        cell.requested_peak = requested
        cell.reserved_peak = reserved_peak
        tracker.reset_peak()
        with tracker:
            train_step(engine, batch)
        cell.tracked_peak = tracker.peak
    return cell
