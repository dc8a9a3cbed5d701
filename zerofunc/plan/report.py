"""What python -m zerofunc.plan reports: one row per plan (a stage, its levers), as a table or JSON
(the plot: plot.py; the searches that choose each plan: search.py). The best is the plan on the
fewest ranks that fits, there the one with the most tokens/s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerofunc.plan import Plan, Simulation
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
    shard_choice: Optional[str] = None  # --shard-group auto: why this group, against the preferred ones

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
            "reduce_dtype": p.reduce_dtype or p.precision,
            "shard_group": p.hybrid_group or p.world_size,
            "hpz": p.hpz_group,
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
            "shard_group_choice": self.shard_choice,
        }


def recommend(reports: list[StageReport]) -> Optional[StageReport]:
    """Of the plans that fit, the one on the fewest ranks, and there the most tokens/s (the fastest
    step, for model states only); ties go to the lower peak memory."""
    fitting = [r for r in reports if r.fits]
    return min(fitting, key=lambda r: (r.sim.plan.world_size, -round(r.tokens_per_s, 3), round(r.sim.step_s, 9),
                                       r.sim.memory.peak), default=None)


# A plan simulates the eager step: torch.compile cannot run on meta tensors here, and would change the
# kernels (fusion), hence activations and time. The trainer compiles by default on CUDA only.
EAGER_NOTE = ("planned eager (torch.compile off); python -m train compiles each block by default on CUDA: "
              "train with --no-compile to run what was planned (--compile whole sends the planned bytes, bucketed, "
              "but its memory and time are not planned: the compiler fuses and schedules)")


def as_json(plan: Plan, reports: list[StageReport], capacity: int, costs: Optional[list] = None,
            gpus_per_node: Optional[int] = None) -> dict:
    best = recommend(reports)
    sizes = sorted({r.sim.plan.world_size for r in reports})
    return {
        "model": plan.model_name if plan.params is None else None,
        "params": reports[0].sim.numel,
        "lora": None if plan.lora is None else {"r": plan.lora.r, "alpha": plan.lora.alpha,
                                                "targets": plan.lora.targets, "trained_params": plan.trained_numel},
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
             micro_batch_auto: bool = False, gpus_per_node: Optional[int] = None, shard_auto: bool = False) -> str:
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
    if plan.lora is not None:
        what += (f", LoRA r {plan.lora.r} (alpha {plan.lora.alpha:g}, {plan.lora.targets}): {plan.trained_numel:,} "
                 "parameters trained, the rest frozen")
    if plan.shard_group is not None:
        what += f", stages 1-3 sharded within groups of {plan.shard_group} ranks"
    elif shard_auto:
        what += ", stages 1-3 sharded within the group that fits and runs fastest (shard: its ranks)"
    ranks = ranks or f"{plan.world_size} ranks"
    host = reports[0].host_capacity
    head = (f"{what}, {ranks}, {plan.precision}, {plan.hardware} ({_gib(capacity)} GiB usable per rank"
            + (f", {_gib(host)} GiB of host memory per rank)" if host is not None else ")"))
    if order:
        reports = sorted(reports, key=lambda r: (not r.fits, -r.tokens_per_s, r.sim.memory.peak))
    hybrid = any(r.sim.plan.hybrid_group for r in reports)  # a column of shard groups where any plan has them
    cols = ["stage", "ranks", *(["shard"] if hybrid else []), "levers", "mb", "params", "grads", "optim", "activ",
            "buffers", "peak GiB", "host GiB", "comm/step GiB", "comm time", "step time", "tokens/s", "fits", "max mb"]
    rows = []
    for r in reports:
        m, p = r.sim.memory.max_by_category, r.sim.plan
        ranks = f">{p.world_size}" if r.beyond else str(p.world_size)
        shard = [str(p.hybrid_group or p.world_size)] if hybrid else []
        rows.append([str(p.stage), ranks, *shard, p.levers, "-" if p.params is not None else str(p.micro_batch),
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
        groups = f" in shard groups of {b.hybrid_group}" if b.hybrid_group else ""
        verdict = (f"recommended: stage {b.stage} on {b.world_size} ranks{groups}{levers}{mb} "
                   f"(the fewest ranks that fit; there, the most tokens/s)")
    choices = [f"shard group, stage {r.sim.plan.stage}: {r.shard_choice}" for r in reports if r.shard_choice]
    lines = [head, "", line(cols), *(line(row) for row in rows), "", *choices, verdict,
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
