"""The searches behind python -m zerofunc.plan: each plan at its largest micro-batch that fits
(`report_stage`), the fewest ranks that fit (`fewest_ranks`, `smallest_fitting`), the shard group (`best_shard_group`),
and what each lever costs (`lever_costs`). With `--levers auto` the plans are every stage x activation
checkpointing x optimizer offload (`lever_configs`); report.py says which is best.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from zerofunc.plan import MAX_MICRO_BATCH, Plan, Simulation, simulate
from zerofunc.plan.report import StageReport
from zerofunc.plan.workers import mapper


@dataclass(frozen=True)
class MemoryLines:
    """Live bytes at every event of a step as a line in the micro-batch: a + b * micro_batch.

    Exact, not fitted: a step runs the same ops in the same order at any micro-batch,
    and every tensor's size is either fixed or proportional to it. Two simulations
    (micro-batch 1 and 2) therefore give every event's line.
    """

    fixed: np.ndarray       # bytes, one per event (int64)
    per_sample: np.ndarray

    @classmethod
    def of(cls, one: Simulation, two: Simulation) -> "MemoryLines":
        t1, t2 = one.memory.timeline.totals, two.memory.timeline.totals  # sim.memory.Timeline
        if len(t1) != len(t2):
            raise RuntimeError("the step's events differ between micro-batches 1 and 2; cannot extrapolate")
        return cls(2 * t1 - t2, t2 - t1)

    def peak(self, micro_batch: int) -> int:
        return int((self.fixed + self.per_sample * micro_batch).max())

    def max_micro_batch(self, capacity: int) -> int:
        """The largest micro-batch whose peak fits `capacity` bytes (0 if none does)."""
        if self.peak(1) > capacity:
            return 0
        growing = self.per_sample > 0
        limits = (capacity - self.fixed[growing]) // self.per_sample[growing]
        return min([MAX_MICRO_BATCH, *limits.tolist()])


_SIMULATED: dict[Plan, Simulation] = {}  # this process's simulations (a forked worker inherits them)
MAX_SIMULATED = 128


def simulated(plan: Plan, timeline: bool = True, timing: bool = True) -> Simulation:
    """`simulate(plan)`, once per plan in this process where one simulation answers both asks: the
    searches probe a plan for memory, then report it, then cost its levers."""
    try:
        have = _SIMULATED.get(plan)
    except TypeError:  # a plan of an unhashable model: simulated each time
        return simulate(plan, timeline=timeline, timing=timing)
    if have is not None and (have.timed or not timing):
        return have
    if len(_SIMULATED) >= MAX_SIMULATED:
        _SIMULATED.clear()
    # the timeline always: it costs little, and a probe's simulation then serves the report's memory lines
    _SIMULATED[plan] = sim = simulate(plan, timeline=True, timing=timing)
    return sim


def report_stage(plan: Plan, capacity: int, timeline: bool = False, host_capacity: Optional[int] = None,
                 micro_batch_cap: Optional[int] = None) -> StageReport:
    """Simulate `plan`, and (for a model) find the largest micro-batch that fits `capacity`.

    The largest micro-batch comes from the memory lines of micro-batches 1 and 2; when
    one sequence alone does not fit, it is 0 and the second simulation is skipped.
    With `micro_batch_cap`, the plan's micro-batch is chosen instead: the largest power
    of two that fits, up to the cap. Under the cost model the time per token never rises
    with the micro-batch (fixed costs spread over more tokens), so that is the fastest;
    a power of two keeps global batches round. A plan where nothing fits is reported at
    micro-batch 1, for memory only.
    """
    if plan.params is not None:
        return StageReport(simulated(plan, timeline=timeline), capacity, None, host_capacity=host_capacity)
    auto = micro_batch_cap is not None
    one = simulated(replace(plan, micro_batch=1), timeline=True, timing=plan.micro_batch == 1 and not auto)
    sims = {1: one}
    if not one.fits(capacity, host_capacity):
        max_micro_batch = 0
    else:
        # timed where it may be the answer: auto picks a power of two, often 2, which then needs no second run
        sims[2] = simulated(replace(plan, micro_batch=2), timeline=True, timing=auto or plan.micro_batch == 2)
        max_micro_batch = MemoryLines.of(one, sims[2]).max_micro_batch(capacity)
    if auto:
        if max_micro_batch == 0:
            return StageReport(one, capacity, 0, host_capacity=host_capacity, timed=False)
        plan = replace(plan, micro_batch=1 << (min(max_micro_batch, micro_batch_cap).bit_length() - 1))
        return StageReport(simulated(plan, timeline=timeline), capacity, max_micro_batch, host_capacity=host_capacity)
    sim = sims[plan.micro_batch] if plan.micro_batch in sims else simulated(plan, timeline=timeline)
    return StageReport(sim, capacity, max_micro_batch, host_capacity=host_capacity)


def lever_configs(base: Plan, stages: list[int], checkpointing: list[str], offload: list[bool]) -> list[Plan]:
    """Every stage x activation checkpointing x optimizer offload asked for (offload needs stage >= 1)."""
    return [replace(base, stage=s, activation_checkpointing=ac, offload_optimizer=off)
            for s in stages for ac in checkpointing for off in offload if not (off and s == 0)]


def lever_costs(best: StageReport) -> list[tuple[str, StageReport]]:
    """The recommended plan once more with each of its levers off (same stage, ranks, micro-batch):
    (what was turned off, that plan's report), to say what each lever costs and saves."""
    p = best.sim.plan
    off = []
    if p.checkpointing.on:
        off.append((f"activation checkpointing ({p.checkpointing.describe()})", replace(p, activation_checkpointing="none")))
    if p.offload_optimizer:
        off.append(("optimizer offload", replace(p, offload_optimizer=False)))
    plans = [q for _, q in off]
    with mapper(min(len(plans), os.cpu_count() or 1), plans) as run:
        sims = run(simulated, plans)
    return [(name, StageReport(sim, best.capacity, None, host_capacity=best.host_capacity))
            for (name, _), sim in zip(off, sims)]


def world_size_candidates(max_world_size: int, gpus_per_node: Optional[int] = None) -> list[int]:
    """The world sizes `auto` tries: powers of two, and past one node whole nodes only."""
    powers = [1 << i for i in range(max_world_size.bit_length()) if 1 << i <= max_world_size]
    if gpus_per_node is None:
        return powers
    within = [n for n in powers if n < gpus_per_node]
    return within + list(range(gpus_per_node, max_world_size + 1, gpus_per_node))


def _probe(plan: Plan) -> Simulation:
    return simulated(plan, timing=False)


def _first_fitting(candidates: list[int], plan_at, fits, workers: int = 1, last_first: bool = False) -> Optional[int]:
    """The first candidate whose plan fits (whatever fits, every later candidate fits too), or None: a
    search that probes `workers` candidates at once, evenly inside what is left (binary with one).
    `last_first`: probe the last candidate alone first, where most plans fit nowhere (the shard group:
    the report needs the fully sharded plan anyway)."""
    lo, hi = 0, len(candidates)  # the answer's index lies in [lo, hi]; hi == len: none fits
    if last_first:
        if not fits(simulated(plan_at(candidates[-1]), timing=False)):
            return None
        hi = len(candidates) - 1
    with mapper(workers, [plan_at(candidates[0])]) as run:
        while lo < hi:
            points = sorted({lo + (hi - lo) * (i + 1) // (workers + 1) for i in range(workers)})
            plans = [plan_at(candidates[i]) for i in points]
            for plan, sim in zip(plans, run(_probe, plans)):
                _SIMULATED.setdefault(plan, sim)  # a forked probe's simulation, for the report that follows
            for i, plan in zip(points, plans):
                if fits(simulated(plan, timing=False)):
                    hi = i
                    break
                lo = i + 1
    return candidates[lo] if lo < len(candidates) else None


def fewest_ranks(plan: Plan, capacity: int, candidates: list[int], host_capacity: Optional[int] = None,
                 micro_batch_cap: Optional[int] = None, fully_sharded: bool = False, workers: int = 1) -> Optional[int]:
    """The smallest candidate world size at which `plan`'s step fits `capacity` (None: not even the
    largest). More ranks do not need more memory per rank (they shard more, activations stay; only
    the padding of each unit to equal shards grows, by under one element per rank). Each probe is at
    micro-batch 1 when the report chooses the micro-batch (`micro_batch_cap`), else at the plan's, and
    `fully_sharded` where the report chooses the shard group; `workers` processes probe at once."""
    probe = replace(plan, micro_batch=1 if micro_batch_cap is not None else plan.micro_batch,
                    shard_group=None if fully_sharded else plan.shard_group)
    return _first_fitting(candidates, lambda n: replace(probe, world_size=n),
                          lambda sim: sim.fits(capacity, host_capacity), workers)


def smallest_fitting(plan: Plan, capacity: int, candidates: list[int], host_capacity: Optional[int] = None,
                     micro_batch_cap: Optional[int] = None, shard_per_node: Optional[int] = None) -> StageReport:
    """The report of `plan` at the fewest candidate ranks it fits on (`fewest_ranks`); if none, at
    the largest candidate, which says by how much. With `shard_per_node` the report chooses the shard
    group (`best_shard_group`)."""
    n = fewest_ranks(plan, capacity, candidates, host_capacity, micro_batch_cap, shard_per_node is not None)
    plan = replace(plan, world_size=candidates[-1] if n is None else n)
    if shard_per_node is not None:
        r = best_shard_group(plan, capacity, False, host_capacity, micro_batch_cap, shard_per_node)
    else:
        r = report_stage(plan, capacity, host_capacity=host_capacity, micro_batch_cap=micro_batch_cap)
    return replace(r, beyond=n is None)


def shard_group_candidates(world_size: int, per_node: int) -> list[int]:
    """The shard groups `--shard-group auto` tries: a node, then whole nodes, each dividing the world
    (the world itself last). A world of one node, or of part-filled nodes, is one group."""
    if world_size <= per_node or world_size % per_node:
        return [world_size]
    return [s for s in range(per_node, world_size + 1, per_node) if world_size % s == 0]


# How far the planner's tokens/s has been shown to miss a run's, set from its largest miss on the published
# H100 runs when compute was one fraction of peak (torchtitan's Llama-3.1-8B on 8 H100s: 5,243 tokens/s per
# GPU planned, 5,762 published, 9.9%; benchmarks/published.py, 2026-11-27). A shard group that is not a
# node's or the world's is chosen only where it wins by more than this. With compute priced per op class the
# published rows are planned 9-41% fast (docs/BENCHMARKS.md), a bias of the compute that every shard group of
# one plan shares; what sets one group apart, its communication, has not been held to a published run. Not
# re-derived since.
PLANNER_ERROR = 0.10


def best_shard_group(plan: Plan, capacity: int, timeline: bool = False, host_capacity: Optional[int] = None,
                     micro_batch_cap: Optional[int] = None, per_node: int = 8) -> StageReport:
    """`plan` at the shard group that fits and runs fastest, preferring a node or full sharding: the
    smallest candidate that fits (a larger group shards more, so needs no more memory per rank), then of
    it and every larger candidate the most tokens/s (ties to the smaller group: fewer ranks per
    collective), but a group other than a node or the whole world only where it plans more than
    PLANNER_ERROR more tokens/s than the better of those two that fit: a smaller win is within what the
    planner has been shown to miss by. The report says the margin. Where no group fits, the fully
    sharded plan, which says by how much. Stage 0 shards nothing."""
    n = plan.world_size
    if plan.stage == 0 or n == 1:
        return report_stage(replace(plan, shard_group=None), capacity, timeline, host_capacity, micro_batch_cap)
    candidates = [s for s in shard_group_candidates(n, per_node) if s % (plan.hpz or 1) == 0]  # hpZ's group inside
    probe = replace(plan, micro_batch=1) if micro_batch_cap is not None else plan
    smallest = _first_fitting(candidates, lambda s: replace(probe, shard_group=None if s == n else s),
                              lambda sim: sim.fits(capacity, host_capacity), last_first=True)
    tried = candidates[candidates.index(smallest):] if smallest is not None else [n]
    reports = [report_stage(replace(plan, shard_group=None if s == n else s), capacity, timeline, host_capacity,
                            micro_batch_cap) for s in tried]
    fitting = [r for r in reports if r.fits]
    if not fitting:
        return reports[-1]  # the fully sharded plan, which says by how much nothing fits

    def size(r: StageReport) -> int:
        return r.sim.plan.shard_group or n

    def fastest(rs: list[StageReport]) -> StageReport:
        return max(rs, key=lambda r: (round(r.tokens_per_s, 3), -size(r)))

    best, preferred = fastest(fitting), [r for r in fitting if size(r) in (per_node, n)]
    pick = fastest(preferred) if preferred else best
    if best is pick:
        return best
    margin = best.tokens_per_s / pick.tokens_per_s - 1
    what = (f"{size(best)} plans {margin:.1%} more tokens/s than {size(pick)} "
            f"({'a node' if size(pick) == per_node else 'the whole world'})")
    if margin > PLANNER_ERROR:
        return replace(best, shard_choice=f"{what}, beyond the planner's {PLANNER_ERROR:.0%} error")
    return replace(pick, shard_choice=f"{size(pick)}; {what}, within the planner's {PLANNER_ERROR:.0%} error")


def report_stages(plans: list[Plan], capacity: int, timeline: bool = False,
                  candidates: Optional[list[int]] = None, host_capacity: Optional[int] = None,
                  micro_batch_cap: Optional[int] = None, shard_per_node: Optional[int] = None) -> list[StageReport]:
    """`report_stage` for each plan, spread over the machine's cores (the plans are independent).

    With `candidates`, each plan is reported at the smallest of those world sizes that fits;
    with `micro_batch_cap`, at the largest micro-batch that fits (see `report_stage`); with
    `shard_per_node` (nodes of that many ranks), at the best shard group (`best_shard_group`).
    """
    n = len(plans)
    if candidates is not None:
        work = (smallest_fitting, plans, [capacity] * n, [candidates] * n, [host_capacity] * n,
                [micro_batch_cap] * n, [shard_per_node] * n)
    elif shard_per_node is not None:
        work = (best_shard_group, plans, [capacity] * n, [timeline] * n, [host_capacity] * n,
                [micro_batch_cap] * n, [shard_per_node] * n)
    else:
        work = (report_stage, plans, [capacity] * n, [timeline] * n, [host_capacity] * n, [micro_batch_cap] * n)
    with mapper(min(n, os.cpu_count() or 1), plans) as run:
        return run(*work)
