"""What python -m zerofunc.plan reports: one row per stage, as a table, JSON or a plot."""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Optional

from sim.memory import CATEGORIES
from zerofunc.plan import MemoryLines, Plan, Simulation, simulate

GiB = 2**30


@dataclass
class StageReport:
    sim: Simulation
    capacity: int
    max_micro_batch: Optional[int]  # None when the plan has no architecture (--params)
    beyond: bool = False            # world size auto: no candidate fits; this is the largest tried

    @property
    def fits(self) -> bool:
        return self.sim.fits(self.capacity)

    @property
    def tokens_per_s(self) -> float:
        """The whole cluster's training throughput at the estimated step time (0 for model states only)."""
        p = self.sim.plan
        return 0.0 if p.params is not None else p.world_size * p.micro_batch * p.tokens / self.sim.step_s

    def as_json(self) -> dict:
        m = self.sim.memory
        cats = m.max_by_category
        return {
            "stage": self.sim.plan.stage,
            "world_size": self.sim.plan.world_size,
            "memory_bytes": {**{c: cats[c] for c in ("params", "grads", "optimizer")},
                             "model_states": m.model_states,
                             **{c: cats[c] for c in ("activations", "buffers", "other")},
                             "peak": m.peak},
            "comm": {"volume_bytes": self.sim.volume_bytes, "collectives": len(self.sim.ledger),
                     "time_s": self.sim.comm_s, "overlapped_time_s": self.sim.overlapped_comm_s},
            "compute": {"flops": self.sim.flops, "time_s": self.sim.compute_s},
            "step_time_s": self.sim.step_s,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
            "none_fit_up_to_this_world_size": self.beyond,
            "max_micro_batch": self.max_micro_batch,
        }


def report_stage(plan: Plan, capacity: int, timeline: bool = False) -> StageReport:
    """Simulate `plan`, and (for a model) find the largest micro-batch that fits `capacity`.

    The largest micro-batch comes from the memory lines of micro-batches 1 and 2; when
    one sequence alone does not fit, it is 0 and the second simulation is skipped.
    """
    if plan.params is not None:
        return StageReport(simulate(plan, timeline=timeline), capacity, None)
    one = simulate(replace(plan, micro_batch=1), timeline=True, timing=plan.micro_batch == 1)
    sims = {1: one}
    if one.memory.peak > capacity:
        max_micro_batch = 0
    else:
        sims[2] = simulate(replace(plan, micro_batch=2), timeline=True, timing=plan.micro_batch == 2)
        max_micro_batch = MemoryLines.of(one, sims[2]).max_micro_batch(capacity)
    sim = sims[plan.micro_batch] if plan.micro_batch in sims else simulate(plan, timeline=timeline)
    return StageReport(sim, capacity, max_micro_batch)


def recommend(reports: list[StageReport]) -> Optional[StageReport]:
    """Of the plans that fit, the one on the fewest ranks, and there the fastest estimated step;
    ties go to the lower peak memory."""
    fitting = [r for r in reports if r.fits]
    return min(fitting, key=lambda r: (r.sim.plan.world_size, round(r.sim.step_s, 9), r.sim.memory.peak), default=None)


def world_size_candidates(max_world_size: int, gpus_per_node: Optional[int] = None) -> list[int]:
    """The world sizes `auto` tries: powers of two, and past one node whole nodes only."""
    powers = [1 << i for i in range(max_world_size.bit_length()) if 1 << i <= max_world_size]
    if gpus_per_node is None:
        return powers
    within = [n for n in powers if n < gpus_per_node]
    return within + list(range(gpus_per_node, max_world_size + 1, gpus_per_node))


def smallest_fitting(plan: Plan, capacity: int, candidates: list[int]) -> StageReport:
    """The report of `plan` at the smallest candidate world size whose step fits `capacity`.

    Binary search over the candidates: more ranks do not need more memory per rank
    (they shard more, activations stay; only the padding of each unit to equal shards
    grows, by under one element per rank). If none fits, the report at the largest
    candidate, which says by how much.
    """
    def peak(n: int) -> int:
        return simulate(replace(plan, world_size=n), timing=False).memory.peak

    lo, hi = 0, len(candidates) - 1
    if peak(candidates[hi]) > capacity:
        return replace(report_stage(replace(plan, world_size=candidates[hi]), capacity), beyond=True)
    while lo < hi:  # invariant: candidates[hi] fits
        mid = (lo + hi) // 2
        if peak(candidates[mid]) <= capacity:
            hi = mid
        else:
            lo = mid + 1
    return report_stage(replace(plan, world_size=candidates[hi]), capacity)


def as_json(plan: Plan, reports: list[StageReport], capacity: int) -> dict:
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
        "stages": [r.as_json() for r in reports],
        "recommended_stage": best.sim.plan.stage if best else None,
        "recommended_world_size": best.sim.plan.world_size if best else None,
    }


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _rate(tokens_per_s: float) -> str:
    return "-" if not tokens_per_s else f"{tokens_per_s:,.0f}"


def as_table(plan: Plan, reports: list[StageReport], capacity: int, ranks: Optional[str] = None) -> str:
    """`ranks` says which world sizes were planned (default: the plan's)."""
    numel = reports[0].sim.numel
    if plan.params is None:
        what = f"{plan.model_name} ({numel:,} parameters), micro-batch {plan.micro_batch} x {plan.tokens} tokens"
    else:
        what = f"{numel:,} parameters, model states only"
    ranks = ranks or f"{plan.world_size} ranks"
    head = f"{what}, {ranks}, {plan.precision}, {plan.hardware} ({_gib(capacity)} GiB usable per rank)"
    cols = ["stage", "ranks", "params", "grads", "optim", "activ", "buffers", "peak GiB", "comm/step GiB",
            "comm time", "step time", "tokens/s", "fits", "max mb"]
    rows = []
    for r in reports:
        m = r.sim.memory.max_by_category
        ranks = f">{r.sim.plan.world_size}" if r.beyond else str(r.sim.plan.world_size)
        rows.append([str(r.sim.plan.stage), ranks, _gib(m["params"]), _gib(m["grads"]),
                     _gib(m["optimizer"]), _gib(m["activations"]), _gib(m["buffers"]), _gib(r.sim.memory.peak),
                     _gib(r.sim.volume_bytes), _time(r.sim.comm_s), _time(r.sim.step_s), _rate(r.tokens_per_s if r.fits else 0),
                     "yes" if r.fits else "NO", "-" if r.max_micro_batch is None else str(r.max_micro_batch)])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    best = recommend(reports)
    verdict = (f"recommended: stage {best.sim.plan.stage} on {best.sim.plan.world_size} ranks "
               "(the fewest ranks that fit; there, the fastest estimated step)" if best
               else _nothing_fits(reports))
    note = ("memory per rank in GiB; comm/step counts an all-reduce of S bytes as 2S and an all-gather or "
            "reduce-scatter as S; step time = compute (roofline) + communication (ring alpha-beta) that the "
            "asynchronous collectives (prefetched gathers, gradient reductions) do not hide behind compute; "
            "tokens/s for the whole cluster")
    return "\n".join([head, "", line(cols), *(line(row) for row in rows), "", verdict, note])


def _nothing_fits(reports: list[StageReport]) -> str:
    least = min(reports, key=lambda r: r.sim.memory.peak)
    m = least.sim.memory
    return (f"nothing fits: the least memory is stage {least.sim.plan.stage}'s {_gib(m.peak)} GiB per rank on "
            f"{least.sim.plan.world_size} ranks, {_gib(m.max_by_category['activations'])} GiB of it activations, "
            "which more ranks do not shrink; lower the micro-batch or sequence, or use a larger device")


def plot(reports: list[StageReport], path: str) -> None:
    """Each stage's memory timeline during one step, categories stacked, one panel per stage.

    Panels share one scale, so stages compare at a glance; the usable memory is drawn
    only when it is on that scale, and named in the title otherwise.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = 1.15 * max(r.sim.memory.peak for r in reports) / GiB
    fig, axes = plt.subplots(len(reports), 1, figsize=(10, 2.4 * len(reports)), sharey=True, squeeze=False)
    for ax, r in zip(axes[:, 0], reports):
        timeline = [(label, v) for label, v in r.sim.memory.timeline if label]  # the step, not the set-up
        series = [[v[i] / GiB for _, v in timeline] for i in range(len(CATEGORIES))]
        ax.stackplot(range(len(timeline)), *series, labels=CATEGORIES)
        ax.set_ylim(0, top)
        capacity = r.capacity / GiB
        if capacity <= top:
            ax.axhline(capacity, color="black", linestyle="--", linewidth=1, label="usable memory")
        for i, (label, _) in enumerate(timeline):
            if i == 0 or label != timeline[i - 1][0]:
                ax.axvline(i, color="grey", linewidth=0.5)
                ax.text(i, top * 0.97, f" {label}", fontsize=7, color="grey", va="top")
        ax.set_ylabel("GiB per rank")
        ax.set_title(f"stage {r.sim.plan.stage}, {r.sim.plan.world_size} ranks: peak {r.sim.memory.peak / GiB:.2f} GiB of {capacity:.1f} GiB usable",
                     fontsize=9, loc="left")
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("allocation events in one training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_stages(plans: list[Plan], capacity: int, timeline: bool = False,
                  candidates: Optional[list[int]] = None) -> list[StageReport]:
    """`report_stage` for each plan, spread over the machine's cores (the plans are independent).

    With `candidates`, each plan is reported at the smallest of those world sizes that fits.
    """
    work = (report_stage, plans, [capacity] * len(plans), [timeline] * len(plans)) if candidates is None else (
        smallest_fitting, plans, [capacity] * len(plans), [candidates] * len(plans))
    workers = min(len(plans), os.cpu_count() or 1)
    if workers <= 1 or any(p.foreign for p in plans):  # a model callable need not pickle
        return list(map(*work))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(*work))
