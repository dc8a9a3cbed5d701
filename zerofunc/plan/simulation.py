"""A plan's simulation: the real training step of a stage, run on meta tensors and measured (the package's
docstring says how); `Simulation` holds what it measured and prices the step's time."""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from sim.attention import TargetAttention
from sim.cost import Replay, ledger_time, replay
from sim.ledger import LedgerEntry
from sim.memory import MemoryReport, MemoryTracker
from sim.meta_cache import MetaKernelCache
from sim.roofline import ADAMW_BYTES_COUNTED, Roofline
from zerofunc.api import initialize
from zerofunc.comm import RecordingCommunicator
from zerofunc.step import train_step

if TYPE_CHECKING:
    from zerofunc.plan import Plan


@dataclass
class Simulation:
    plan: Plan
    numel: int                 # parameters, Ψ
    memory: MemoryReport
    ledger: list[LedgerEntry]
    flops: int                 # this rank's, one step
    compute_s: float
    comm_s: float
    overlapped_comm_s: float = 0.0  # the part of comm_s launched asynchronously
    offload_s: dict = field(default_factory=lambda: {"host": 0.0, "d2h": 0.0, "h2d": 0.0})  # optimizer offload
    timed: bool = True         # False: simulated for memory only (compute_s and flops are 0)
    exposed_comm_s: float = 0.0  # what of comm_s the compute cannot hide, by the step's schedule
    comm_slowed_s: float = 0.0   # what the collectives running beside the compute take from it (their SMs)
    compute_by_bound: dict = field(default_factory=dict)  # compute_s by what bounds each op (sim.kernel_cost)

    @property
    def step_s(self) -> float:
        """Compute plus what it cannot hide, as the trainer overlaps it:
        - the collectives the step waits for before they are done, and those still running when its compute
          ends (`exposed_comm_s`, sim.cost.exposed_comm_s: blocking ones, a prefetch not finished by the
          block that needs it, the reductions after backward's last block); what runs behind compute costs
          1 - the profile's `overlap_hidden` of itself (0 on a GPU; on a CPU rank, whose one core runs
          both, what was measured), and on a GPU its link's share of the compute while it runs
          (`comm_slowed_s`: NCCL's kernels take SMs);
        - with optimizer offload, the gradients' copies to the host, hidden behind the compute at
          `overlap_hidden` of whichever is shorter, and the update on the host, while each unit's new
          weights go up to the device behind the next unit's update: the longer of the two.
        Recomputation needs no term: the roofline counts the recomputed forward's ops."""
        h, d2h = self.plan.profile.overlap_hidden, self.offload_s["d2h"]
        behind = max(0.0, self.comm_s - self.exposed_comm_s)
        return (self.compute_s + self.exposed_comm_s + self.comm_slowed_s + (1 - h) * behind + d2h - h * min(d2h, self.compute_s)
                + max(self.offload_s["host"], self.offload_s["h2d"]))

    @property
    def volume_bytes(self) -> int:
        return sum(e.volume_bytes for e in self.ledger)

    def fits(self, capacity: int, host_capacity: Optional[int] = None) -> bool:
        """Device memory within `capacity`, and host memory within `host_capacity` (when given)."""
        return self.memory.peak <= capacity and (host_capacity is None or self.memory.host_peak <= host_capacity)


def simulate(plan: Plan, timeline: bool = False, timing: bool = True, kernel_cache: bool = True) -> Simulation:
    """Run one training step of `plan` on meta tensors and measure it.

    `timing=False` skips the roofline (compute time and FLOPs are then 0) for a
    simulation that only needs memory. `kernel_cache=False` runs every meta kernel
    (sim.meta_cache; the result is the same, only slower).
    """
    profile = plan.profile
    # each group's link also chooses its collectives, as the backend's rates do in a real run
    links = {"world": profile.link(plan.world_size)}
    replicas = None
    if plan.hybrid_group is None:
        comm = RecordingCommunicator(0, plan.world_size, staging=profile.collective_staging, link=links["world"])
    else:  # shard groups of consecutive ranks; a replica group takes every s-th rank (sim.network)
        s, n = plan.hybrid_group, plan.world_size
        links |= {"shard": profile.link(s, 1, n), "replicas": profile.link(n // s, s, n)}
        comm = RecordingCommunicator(0, s, staging=profile.collective_staging, link=links["shard"])
        replicas = RecordingCommunicator(0, plan.world_size // s, ledger=comm.ledger,
                                         staging=profile.collective_staging, link=links["replicas"])
        comm.group_name, replicas.group_name = "shard", "replicas"
    secondary = None
    if plan.hpz_group is not None:  # hpZ: k consecutive ranks inside the shard group
        k = plan.hpz_group
        links["secondary"] = profile.link(k, 1, plan.world_size)
        secondary = RecordingCommunicator(0, k, ledger=comm.ledger, staging=profile.collective_staging,
                                          link=links["secondary"])
        secondary.group_name = "secondary"
    tracker = MemoryTracker(keep_timeline=timeline, workspaces=profile.matmul_workspace)
    roofline = Roofline(profile.flops, profile.memory_bandwidth,
                        host_bytes_per_s=profile.cpu_adamw_params_per_s * ADAMW_BYTES_COUNTED,
                        link_bytes_per_s=profile.host_link_bandwidth, op_overhead_s=profile.op_overhead_s,
                        compute_efficiency=profile.compute_efficiency, kernels=profile.kernels)
    for group in (comm, replicas, secondary):  # each collective's launch and wait, at the compute's seconds
        if group is not None and timing:
            group.clock = lambda: roofline.time_s
    model = plan.build()
    # Built as the trainer builds it (fp16's loss scaler included), only on meta and without weights.
    engine = initialize(model, plan.zero_config(), device="meta", comm=comm, replicas=replicas, secondary=secondary,
                        memory=tracker, init=lambda name, shape: None, compile=False)
    batch = () if plan.params is not None else _meta_batch(plan, model)
    # the kernel cache sits below the instruments: they see every op, each layer's meta kernels run once
    with MetaKernelCache() if kernel_cache else contextlib.nullcontext(), tracker, roofline if timing else contextlib.nullcontext(), TargetAttention(profile.attention):
        train_step(engine, [batch] * plan.grad_accum)
    ledger = list(comm.ledger)
    schedule = replay(ledger, comm.ledger.events, links, roofline.time_s) if timing else Replay(0.0, 0.0)
    return Simulation(plan, engine.numel, tracker.report(), ledger, roofline.flops, roofline.time_s,
                      ledger_time(ledger, links), ledger_time([e for e in ledger if e.overlapped], links),
                      dict(roofline.elsewhere_s), timing, schedule.exposed_s, schedule.slowed_s,
                      dict(roofline.time_by_bound))


def _meta_batch(plan: Plan, model: nn.Module) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """Token ids and targets of one micro-batch, as the model takes them: (inputs, targets) for
    zerofunc's models and any module that takes them so, input_ids= and labels= for Hugging Face's."""
    shape = (plan.micro_batch, plan.tokens)
    ids, targets = (torch.zeros(shape, dtype=torch.long, device="meta") for _ in range(2))
    if plan.foreign and "input_ids" in inspect.signature(model.forward).parameters:
        return {"input_ids": ids, "labels": targets}
    return ids, targets
