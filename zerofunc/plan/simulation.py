"""A plan's simulation: the real training step of a stage, run on meta tensors and measured (the package's
docstring says how); `Simulation` holds what it measured and prices the step's time."""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.nn as nn

from sim.attention import TargetAttention
from sim.cost import Link, Replay, ledger_time, replay
from sim.known_values import KnownValues, UnknownValue
from sim.ledger import LedgerEntry
from sim.memory import CATEGORIES, MemoryReport, MemoryTracker, report_of
from sim.meta_cache import MetaKernelCache
from sim.roofline import ADAMW_BYTES_COUNTED, Roofline
from sim.tensors import tensors
from zerofunc.api import default_units, initialize
from zerofunc.comm import RecordingCommunicator
from zerofunc.plan.folding import in_flight, runs, shortened, stack
from zerofunc.plan.folding import fold as fold_runs
from zerofunc.plan.growth import Measured
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
    folded: bool = False         # runs of identical blocks simulated short and extended (zerofunc.plan.folding)

    @property
    def step_s(self) -> float:
        """Compute plus what it cannot hide, as the trainer overlaps it:
        - the collectives the step waits for before they are done, and those still running when its compute
          ends (`exposed_comm_s`, sim.cost.replay: blocking ones, a prefetch not finished by the
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


def simulate(plan: Plan, timeline: bool = False, timing: bool = True, kernel_cache: bool = True,
             fold: bool = True) -> Simulation:
    """Run one training step of `plan` on meta tensors and measure it.

    `timing=False` skips the roofline (compute time and FLOPs are then 0) for a
    simulation that only needs memory. `kernel_cache=False` runs every meta kernel
    (sim.meta_cache; the result is the same, only slower). `fold=False` simulates every block,
    where the default simulates a run of identical blocks at three short lengths and extends it
    (zerofunc.plan.folding; the result is the same, checked as it is made).

    A model whose forward reads a value (an `if mask.all()`: a meta tensor has none) is simulated again,
    knowing the batch's values and those computed from them alone (sim/known_values.py), and from then on
    knowing them from the start.
    """
    model, units, block_runs = _built(plan)
    if model not in _READS_VALUES:
        try:
            return _simulated(plan, model, units, block_runs, timeline, timing, kernel_cache, fold, False)
        except (RuntimeError, NotImplementedError):  # as a meta kernel refuses to read a value it has not
            pass  # (any other error the step raises again, knowing values)
    simulation = _simulated(plan, model, units, block_runs, timeline, timing, kernel_cache, fold, True)
    _READS_VALUES.add(model)
    return simulation


# the built models whose forward reads a value (sim.known_values): simulated knowing the batch's from the start
_READS_VALUES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _simulated(plan: Plan, model: nn.Module, units: list[str], block_runs: Optional[list[int]], timeline: bool,
               timing: bool, kernel_cache: bool, fold: bool, values: bool) -> Simulation:
    measured = folded = None
    if fold:
        def at(lengths: list[int]) -> Measured:
            return _measure(plan, shortened(model, units, lengths, block_runs), timing, kernel_cache, values)
        # a run is cut to what the step needs to reach its steady pattern: the blocks gathered ahead, those whose
        # collectives stay in flight, and one period of layer-selective AC (one block in `every` recomputes)
        period = plan.checkpointing.every if plan.checkpointing.mode == "selective" else 1
        keep = plan.prefetch_depth + in_flight(model, units, plan.bucket_bytes) + period
        measured = folded = fold_runs(model, units, keep, at, period, block_runs)
    if measured is None:
        measured = _measure(plan, model, timing, kernel_cache, values)
    memory = report_of(measured.labels, measured.live, timeline)
    links = _links(plan)
    ledger, sums = measured.ledger, measured.sums
    schedule = replay(ledger, measured.events, links, sums["compute_s"]) if timing else Replay(0.0, 0.0)
    return Simulation(plan, measured.numel, memory, ledger, int(round(sums["flops"])), sums["compute_s"],
                      ledger_time(ledger, links), ledger_time([e for e in ledger if e.overlapped], links),
                      {k: sums[f"elsewhere:{k}"] for k in ("host", "d2h", "h2d")}, timing, schedule.exposed_s,
                      schedule.slowed_s, {k.removeprefix("bound:"): v for k, v in sums.items() if k.startswith("bound:")},
                      folded is not None)


_BUILT: dict[tuple, tuple[nn.Module, list[str], Optional[list[int]]]] = {}  # this process's, by model


def _built(plan: Plan) -> tuple[nn.Module, list[str], Optional[list[int]]]:
    """The plan's model on meta, its units and the runs of identical blocks in them: built once per process
    for all plans of one model (a command simulates one model 35 times or more, and a 70B model took a
    fifth of each folded simulation to build and compare its blocks). A simulation leaves the model as it
    was: it runs shortened copies of it, or, unfolded, binds its weights for one call (and meta parameters
    stay the module's: zerofunc.api). A model callable is called once per process."""
    key = (plan.model if plan.foreign or plan.params is not None else plan.config, plan.params, plan.lora)
    try:
        return _BUILT[key]
    except TypeError:  # an unhashable model callable: built each time
        return _build(plan)
    except KeyError:
        if len(_BUILT) >= 4:  # a few models at most: each holds a model's modules
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = built = _build(plan)
        return built


def _build(plan: Plan) -> tuple[nn.Module, list[str], Optional[list[int]]]:
    model = plan.build()
    units = default_units(model)
    located = stack(model, units)
    return model, units, runs(located[2]) if located is not None else None


def _links(plan: Plan) -> dict[str, Link]:
    """Each communicator's link by group name: the world, or under hybrid sharding the shard and replica
    groups; hpZ's secondary group (sim.network: a group's link is that of the nodes it spans)."""
    profile, n = plan.profile, plan.world_size
    links = {"world": profile.link(n)}
    if plan.hybrid_group is not None:  # shard groups of consecutive ranks; a replica group takes every s-th rank
        s = plan.hybrid_group
        links |= {"shard": profile.link(s, 1, n), "replicas": profile.link(n // s, s, n)}
    if plan.hpz_group is not None:  # hpZ: k consecutive ranks inside the shard group
        links["secondary"] = profile.link(plan.hpz_group, 1, n)
    return links


def _measure(plan: Plan, model: nn.Module, timing: bool, kernel_cache: bool, values: bool) -> Measured:
    """One step of `model` under `plan` on meta tensors, with the memory tracker, the roofline and the
    recording communicators watching; `values`: knowing the batch's values, and those computed from them
    (sim.known_values), for a model whose forward reads one."""
    profile, links = plan.profile, _links(plan)
    # each group's link also chooses its collectives, as the backend's rates do in a real run
    replicas = secondary = None
    if plan.hybrid_group is None:
        comm = RecordingCommunicator(0, plan.world_size, staging=profile.collective_staging, link=links["world"])
    else:
        s = plan.hybrid_group
        comm = RecordingCommunicator(0, s, staging=profile.collective_staging, link=links["shard"])
        replicas = RecordingCommunicator(0, plan.world_size // s, ledger=comm.ledger,
                                         staging=profile.collective_staging, link=links["replicas"])
        comm.group_name, replicas.group_name = "shard", "replicas"
    if plan.hpz_group is not None:
        secondary = RecordingCommunicator(0, plan.hpz_group, ledger=comm.ledger, staging=profile.collective_staging,
                                          link=links["secondary"])
        secondary.group_name = "secondary"
    tracker = MemoryTracker(workspaces=profile.matmul_workspace, keep_samples=True)
    roofline = Roofline(profile.flops, profile.memory_bandwidth,
                        host_bytes_per_s=profile.cpu_adamw_params_per_s * ADAMW_BYTES_COUNTED,
                        link_bytes_per_s=profile.host_link_bandwidth, op_overhead_s=profile.op_overhead_s,
                        compute_efficiency=profile.compute_efficiency, kernels=profile.kernels)
    for group in (comm, replicas, secondary):  # each collective's launch and wait, at the compute's seconds
        if group is not None and timing:
            group.clock = lambda: roofline.time_s
    # Built as the trainer builds it (fp16's loss scaler included), only on meta and without weights.
    engine = initialize(model, plan.zero_config(), device="meta", comm=comm, replicas=replicas, secondary=secondary,
                        memory=tracker, init=lambda name, shape: None, compile=False)
    host = () if plan.params is not None else _host_batch(plan, model)
    batch = _on_meta(host)
    known = KnownValues() if values else None
    if known is not None:
        for t, value in zip(tensors(batch), tensors(host)):
            known.know(t, value)
    # the kernel cache sits below the instruments: they see every op, each layer's meta kernels run once; the
    # known values above them, whose own work on the host they do not see
    instruments = (MetaKernelCache() if kernel_cache else None, tracker, roofline if timing else None,
                   TargetAttention(profile.attention), known)
    with contextlib.ExitStack() as entered:
        for instrument in (i for i in instruments if i is not None):
            entered.enter_context(instrument)
        try:
            train_step(engine, [batch] * plan.grad_accum)
        except UnknownValue as e:
            raise ValueError(f"{type(model).__name__}'s forward reads a value ({_reader(e)}) the planner cannot know: "
                             "on meta tensors it knows the batch's values (full rows, no padding) and those computed "
                             "from them alone, not the weights', the activations' or a random draw's") from None
    sums = {"flops": float(roofline.flops), "compute_s": roofline.time_s,
            **{f"elsewhere:{k}": v for k, v in roofline.elsewhere_s.items()},
            **{f"bound:{k}": v for k, v in roofline.time_by_bound.items()}}
    live = np.array(tracker.samples, dtype=np.int64).reshape(len(tracker.samples), 2 * len(CATEGORIES))
    return Measured(engine.numel, tracker.sample_labels, live, list(comm.ledger), list(comm.ledger.events), sums)


def _reader(e: BaseException) -> str:
    """Where the model's code read a value (`.item()`, `if t.all()`): the innermost frame of the error's
    traceback outside torch and this project (the planner's instruments, the step), as file:line."""
    ours = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["zerofunc"], sys.modules["sim"]))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(ours)]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "inside torch"


def _host_batch(plan: Plan, model: nn.Module) -> Any:
    """One micro-batch as the trainer feeds it, with values, on the host: the plan's own (`Plan.batch`), or token
    ids as a trainer's packed batch has them (`_token_values`), as the model takes them: input_ids= and labels=
    for Hugging Face's, (inputs, targets) for zerofunc's and any module that takes them so."""
    if plan.batch is not None:
        batch = plan.batch(plan.micro_batch, plan.tokens)
        if not isinstance(batch, (tuple, list, dict)) or next(tensors(batch), None) is None:
            raise ValueError(f"batch= returned {type(batch).__name__}: give a tuple of the model's positional "
                             "arguments or a dict of its keyword ones, tensors among them")
        return batch
    ids = _token_values(model, torch.Size((plan.micro_batch, plan.tokens)))
    if plan.foreign and "input_ids" in inspect.signature(model.forward).parameters:
        return {"input_ids": ids, "labels": ids.clone()}
    return ids, ids.clone()


def _token_values(model: nn.Module, shape: torch.Size) -> torch.Tensor:
    """Token ids for the batch the planner simulates, as a trainer's packed batch has them: every row full, so
    none is the pad id, nor another special id of the model's config; the same ids as labels, each a target."""
    config = getattr(model, "config", None)
    try:  # a Hugging Face model's own (not every one implements it), else the first embedding
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(config, "vocab_size", None) or 1
    special = set()
    for name in ("pad", "bos", "eos", "decoder_start"):  # an id, or a list of them (Llama 3's eos), or None
        given = getattr(config, f"{name}_token_id", None)
        special.update(given if isinstance(given, (list, tuple)) else [given])
    ids = torch.tensor([i for i in range(min(vocab, 1024)) if i not in special] or [0])
    return ids[torch.arange(shape.numel()) % len(ids)].reshape(shape)


def _on_meta(x: Any) -> Any:
    """`x` with each tensor in it replaced by an empty one of its shape on meta (anything else as it is)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, dict):
        return {k: _on_meta(v) for k, v in x.items()}
    return type(x)(_on_meta(v) for v in x) if isinstance(x, (tuple, list)) else x
