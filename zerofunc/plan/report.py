"""What python -m zerofunc.plan reports: one row per plan (a stage, its levers), as a table or JSON (the plot: plot.py).

With `--levers auto` the plans are every stage x activation checkpointing x optimizer
offload, each at the largest micro-batch that fits (`search_levers`); the best is the
one with the most tokens/s that fits, and what its levers cost is measured by planning
it once more with each of them off (`lever_costs`).
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Optional

from zerofunc.plan import MemoryLines, Plan, Simulation, simulate
from zerofunc.plan.command import command, command_lines

GiB = 2**30


@dataclass
class StageReport:
    sim: Simulation
    capacity: int
    max_micro_batch: Optional[int]  # None when the plan has no architecture (--params)
    beyond: bool = False            # world size auto: no candidate fits; this is the largest tried
    host_capacity: Optional[int] = None  # host memory per rank, checked when given
    timed: bool = True              # False: a plan that does not fit, simulated for memory only

    @property
    def fits(self) -> bool:
        return self.sim.fits(self.capacity, self.host_capacity)

    @property
    def tokens_per_s(self) -> float:
        """The whole cluster's training throughput at the estimated step time (0 for model states only)."""
        p = self.sim.plan
        if p.params is not None or not self.timed:
            return 0.0
        return p.world_size * p.micro_batch * p.grad_accum * p.tokens / self.sim.step_s

    def as_json(self) -> dict:
        m = self.sim.memory
        cats = m.max_by_category
        p = self.sim.plan
        return {
            "stage": p.stage,
            "world_size": p.world_size,
            "micro_batch": p.micro_batch if p.params is None else None,
            "grad_accum": p.grad_accum,
            "shard_group": p.hybrid_group or p.world_size,
            "activation_checkpointing": p.activation_checkpointing,
            "ac_every": p.ac_every if p.activation_checkpointing == "selective" else None,
            "offload_optimizer": "cpu" if p.offload_optimizer else "none",
            "memory_bytes": {**{c: cats[c] for c in ("params", "grads", "optimizer")},
                             "model_states": m.model_states,
                             **{c: cats[c] for c in ("activations", "buffers", "other")},
                             "peak": m.peak},
            "host_memory_bytes": {**{c: m.host_max_by_category[c] for c in ("grads", "optimizer")},
                                  "peak": m.host_peak},
            "offload_time_s": dict(self.sim.offload_s),
            "comm": {"volume_bytes": self.sim.volume_bytes, "collectives": len(self.sim.ledger),
                     "time_s": self.sim.comm_s, "overlapped_time_s": self.sim.overlapped_comm_s},
            "compute": {"flops": self.sim.flops, "time_s": self.sim.compute_s},
            "step_time_s": self.sim.step_s if self.timed else None,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
            "none_fit_up_to_this_world_size": self.beyond,
            "max_micro_batch": self.max_micro_batch,
        }


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
        return StageReport(simulate(plan, timeline=timeline), capacity, None, host_capacity=host_capacity)
    auto = micro_batch_cap is not None
    one = simulate(replace(plan, micro_batch=1), timeline=True, timing=plan.micro_batch == 1 and not auto)
    sims = {1: one}
    if not one.fits(capacity, host_capacity):
        max_micro_batch = 0
    else:
        sims[2] = simulate(replace(plan, micro_batch=2), timeline=True, timing=plan.micro_batch == 2 and not auto)
        max_micro_batch = MemoryLines.of(one, sims[2]).max_micro_batch(capacity)
    if auto:
        if max_micro_batch == 0:
            return StageReport(one, capacity, 0, host_capacity=host_capacity, timed=False)
        plan = replace(plan, micro_batch=1 << (min(max_micro_batch, micro_batch_cap).bit_length() - 1))
        return StageReport(simulate(plan, timeline=timeline), capacity, max_micro_batch, host_capacity=host_capacity)
    sim = sims[plan.micro_batch] if plan.micro_batch in sims else simulate(plan, timeline=timeline)
    return StageReport(sim, capacity, max_micro_batch, host_capacity=host_capacity)


def recommend(reports: list[StageReport]) -> Optional[StageReport]:
    """Of the plans that fit, the one on the fewest ranks, and there the most tokens/s (the fastest
    step, for model states only); ties go to the lower peak memory."""
    fitting = [r for r in reports if r.fits]
    return min(fitting, key=lambda r: (r.sim.plan.world_size, -round(r.tokens_per_s, 3), round(r.sim.step_s, 9),
                                       r.sim.memory.peak), default=None)


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
    return [(name, StageReport(simulate(q), best.capacity, None, host_capacity=best.host_capacity)) for name, q in off]


def world_size_candidates(max_world_size: int, gpus_per_node: Optional[int] = None) -> list[int]:
    """The world sizes `auto` tries: powers of two, and past one node whole nodes only."""
    powers = [1 << i for i in range(max_world_size.bit_length()) if 1 << i <= max_world_size]
    if gpus_per_node is None:
        return powers
    within = [n for n in powers if n < gpus_per_node]
    return within + list(range(gpus_per_node, max_world_size + 1, gpus_per_node))


def smallest_fitting(plan: Plan, capacity: int, candidates: list[int], host_capacity: Optional[int] = None,
                     micro_batch_cap: Optional[int] = None) -> StageReport:
    """The report of `plan` at the smallest candidate world size whose step fits `capacity`.

    Binary search over the candidates: more ranks do not need more memory per rank
    (they shard more, activations stay; only the padding of each unit to equal shards
    grows, by under one element per rank). If none fits, the report at the largest
    candidate, which says by how much. Each probe is at micro-batch 1 when the report
    chooses the micro-batch (`micro_batch_cap`), else at the plan's.
    """
    probe = replace(plan, micro_batch=1) if micro_batch_cap is not None else plan

    def fits(n: int) -> bool:
        return simulate(replace(probe, world_size=n), timing=False).fits(capacity, host_capacity)

    def report(n: int, beyond: bool = False) -> StageReport:
        r = report_stage(replace(plan, world_size=n), capacity, host_capacity=host_capacity, micro_batch_cap=micro_batch_cap)
        return replace(r, beyond=beyond)

    lo, hi = 0, len(candidates) - 1
    if not fits(candidates[hi]):
        return report(candidates[hi], beyond=True)
    while lo < hi:  # invariant: candidates[hi] fits
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return report(candidates[hi])


# A plan simulates the eager step: torch.compile cannot run on meta tensors here, and would change the
# kernels (fusion), hence activations and time. The trainer compiles by default on CUDA only.
EAGER_NOTE = ("planned eager (torch.compile off); python -m train compiles each block by default on CUDA: "
              "train with --no-compile to run what was planned")


def as_json(plan: Plan, reports: list[StageReport], capacity: int, costs: Optional[list] = None,
            gpus_per_node: Optional[int] = None) -> dict:
    best = recommend(reports)
    sizes = sorted({r.sim.plan.world_size for r in reports})
    return {
        "model": plan.model_name if plan.params is None else None,
        "params": reports[0].sim.numel,
        "world_size": sizes[0] if len(sizes) == 1 else None,
        "world_sizes": sizes,
        "precision": plan.precision,
        "micro_batch": plan.micro_batch if plan.params is None else None,
        "seq": plan.tokens if plan.params is None else None,
        "hardware": plan.hardware,
        "capacity_bytes": capacity,
        "host_capacity_bytes": reports[0].host_capacity,
        "stages": [r.as_json() for r in reports],
        "recommended_stage": best.sim.plan.stage if best else None,
        "recommended_world_size": best.sim.plan.world_size if best else None,
        "recommended": best.as_json() if best else None,
        "recommended_command": command(best.sim.plan, gpus_per_node) if best else None,  # argv, or null
        "lever_costs": [{"lever": name, "without_it": r.as_json()} for name, r in costs or []],
        "compiled": False,  # see EAGER_NOTE
    }


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _rate(tokens_per_s: float) -> str:
    return "-" if not tokens_per_s else f"{tokens_per_s:,.0f}"


def as_table(plan: Plan, reports: list[StageReport], capacity: int, ranks: Optional[str] = None,
             costs: Optional[list[tuple[str, StageReport]]] = None, order: bool = False,
             micro_batch_auto: bool = False, gpus_per_node: Optional[int] = None) -> str:
    """`ranks` says which world sizes were planned (default: the plan's). `order` lists the plans
    that fit first, the most tokens/s first (a lever search); else in the given order. The
    recommendation comes with the command that trains it (command.py)."""
    numel = reports[0].sim.numel
    if plan.params is None:
        mb = "micro-batch: the largest that fits" if micro_batch_auto else f"micro-batch {plan.micro_batch}"
        what = f"{plan.model_name} ({numel:,} parameters), {mb} x {plan.tokens} tokens"
        if plan.grad_accum > 1:
            what += f", {plan.grad_accum} micro-steps per optimizer step (comm and time per step)"
    else:
        what = f"{numel:,} parameters, model states only"
    if plan.shard_group is not None:
        what += f", stages 1-3 sharded within groups of {plan.shard_group} ranks"
    ranks = ranks or f"{plan.world_size} ranks"
    host = reports[0].host_capacity
    head = (f"{what}, {ranks}, {plan.precision}, {plan.hardware} ({_gib(capacity)} GiB usable per rank"
            + (f", {_gib(host)} GiB of host memory per rank)" if host is not None else ")"))
    if order:
        reports = sorted(reports, key=lambda r: (not r.fits, -r.tokens_per_s, r.sim.memory.peak))
    cols = ["stage", "ranks", "levers", "mb", "params", "grads", "optim", "activ", "buffers", "peak GiB", "host GiB",
            "comm/step GiB", "comm time", "step time", "tokens/s", "fits", "max mb"]
    rows = []
    for r in reports:
        m, p = r.sim.memory.max_by_category, r.sim.plan
        ranks = f">{p.world_size}" if r.beyond else str(p.world_size)
        rows.append([str(p.stage), ranks, p.levers, "-" if p.params is not None else str(p.micro_batch),
                     _gib(m["params"]), _gib(m["grads"]), _gib(m["optimizer"]), _gib(m["activations"]),
                     _gib(m["buffers"]), _gib(r.sim.memory.peak), _gib(r.sim.memory.host_peak),
                     _gib(r.sim.volume_bytes), _time(r.sim.comm_s), _time(r.sim.step_s) if r.timed else "-",
                     _rate(r.tokens_per_s if r.fits else 0),
                     "yes" if r.fits else "NO", "-" if r.max_micro_batch is None else str(r.max_micro_batch)])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    best = recommend(reports)
    if best is None:
        verdict = _nothing_fits(reports)
    else:
        b = best.sim.plan
        levers = f", levers: {b.levers}" if order or b.levers != "none" else ""
        mb = f", micro-batch {b.micro_batch}" if micro_batch_auto and b.params is None else ""
        verdict = (f"recommended: stage {b.stage} on {b.world_size} ranks{levers}{mb} "
                   f"(the fewest ranks that fit; there, the most tokens/s)")
    lines = [head, "", line(cols), *(line(row) for row in rows), "", verdict,
             *(command_lines(best.sim.plan, gpus_per_node) if best is not None else [])]
    if best is not None and costs:
        lines.append("what its levers cost (the same plan with one lever off):")
        for name, without in costs:
            dt = best.sim.step_s / without.sim.step_s - 1
            saved = without.sim.memory.peak - best.sim.memory.peak
            host = best.sim.memory.host_peak - without.sim.memory.host_peak
            lines.append(f"  {name}: {dt:+.0%} step time; {_gib(saved)} GiB less device memory per rank"
                         + (f" for {_gib(host)} GiB of host memory" if host > 0 else "")
                         + ("" if without.fits else f" (without it: {_gib(without.sim.memory.peak)} GiB, does not fit)"))
    lines.append("memory per rank in GiB (host: pinned host memory, optimizer offload); levers: AC = activation "
                 "checkpointing (full, or one block in K), offload = optimizer state and update on the host; mb = "
                 "micro-batch; comm/step counts an all-reduce of S bytes as 2S and an all-gather or reduce-scatter as S; "
                 "step time = compute (roofline, recomputation included) + what it does not hide: communication (ring "
                 "alpha-beta) and offload's copies beyond compute, the host update; tokens/s for the whole cluster")
    if plan.profile.device_names:  # a GPU's profile
        lines.append(EAGER_NOTE)
    return "\n".join(lines)


def _nothing_fits(reports: list[StageReport]) -> str:
    least = min(reports, key=lambda r: r.sim.memory.peak)
    m, p = least.sim.memory, least.sim.plan
    host = least.host_capacity
    if host is not None and m.host_peak > host and all(r.sim.memory.host_peak > host for r in reports if r.sim.fits(r.capacity)):
        why = f"; it needs {_gib(m.host_peak)} GiB of host memory per rank, more than the {_gib(host)} GiB there"
    else:
        why = ""
    return (f"nothing fits: the least memory is stage {p.stage}'s {_gib(m.peak)} GiB per rank on "
            f"{p.world_size} ranks (levers: {p.levers}), {_gib(m.max_by_category['activations'])} GiB of it activations, "
            f"which more ranks do not shrink{why}; lower the micro-batch or sequence, or use a larger device")


def report_stages(plans: list[Plan], capacity: int, timeline: bool = False,
                  candidates: Optional[list[int]] = None, host_capacity: Optional[int] = None,
                  micro_batch_cap: Optional[int] = None) -> list[StageReport]:
    """`report_stage` for each plan, spread over the machine's cores (the plans are independent).

    With `candidates`, each plan is reported at the smallest of those world sizes that fits;
    with `micro_batch_cap`, at the largest micro-batch that fits (see `report_stage`).
    """
    n = len(plans)
    if candidates is None:
        work = (report_stage, plans, [capacity] * n, [timeline] * n, [host_capacity] * n, [micro_batch_cap] * n)
    else:
        work = (smallest_fitting, plans, [capacity] * n, [candidates] * n, [host_capacity] * n, [micro_batch_cap] * n)
    workers = min(n, os.cpu_count() or 1)
    if workers <= 1 or any(p.foreign for p in plans):  # a model callable need not pickle
        return list(map(*work))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(*work))
