"""The memory-timeline plot of python -m zerofunc.plan --plot: device memory by category, host memory, recomputation."""
from __future__ import annotations

from sim.memory import CATEGORIES
from zerofunc.plan.report import GiB, StageReport


def plot(reports: list[StageReport], path: str) -> None:
    """Each plan's memory timeline during one step: device memory by category, stacked, and host
    memory as a line; the spans where backward recomputes a checkpointed block are shaded. One
    panel per plan, on one scale, so plans compare at a glance; the usable memory is drawn
    only when it is on that scale, and named in the title otherwise.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = 1.15 * max(max(r.sim.memory.peak, r.sim.memory.host_peak) for r in reports) / GiB
    fig, axes = plt.subplots(len(reports), 1, figsize=(10, 2.4 * len(reports)), sharey=True, squeeze=False)
    for ax, r in zip(axes[:, 0], reports):
        timeline = [(label, v, h) for label, v, h in r.sim.memory.timeline if label]  # the step, not the set-up
        series = [[v[i] / GiB for _, v, _ in timeline] for i in range(len(CATEGORIES))]
        ax.stackplot(range(len(timeline)), *series, labels=CATEGORIES)
        if any(h for _, _, h in timeline):
            ax.plot(range(len(timeline)), [h / GiB for _, _, h in timeline], color="black", linewidth=1.2,
                    label="host memory")
        ax.set_ylim(0, top)
        capacity = r.capacity / GiB
        if capacity <= top:
            ax.axhline(capacity, color="black", linestyle="--", linewidth=1, label="usable device memory")
        recompute_shown = False
        for i, (label, _, _) in enumerate(timeline):
            if label == "recompute":
                ax.axvspan(i - 0.5, i + 0.5, color="red", alpha=0.15, linewidth=0,
                           label=None if recompute_shown else "recomputation")
                recompute_shown = True
            elif i == 0 or label != timeline[i - 1][0] and (label, timeline[i - 1][0]) != ("backward", "recompute"):
                ax.axvline(i, color="grey", linewidth=0.5)
                ax.text(i, top * 0.97, f" {label}", fontsize=7, color="grey", va="top")
        ax.set_ylabel("GiB per rank")
        p = r.sim.plan
        mb = f", micro-batch {p.micro_batch}" if p.params is None else ""
        ax.set_title(f"stage {p.stage}, {p.world_size} ranks, levers: {p.levers}{mb}: device peak "
                     f"{r.sim.memory.peak / GiB:.2f} GiB of {capacity:.1f} GiB usable, host {r.sim.memory.host_peak / GiB:.2f} GiB",
                     fontsize=9, loc="left")
        ax.legend(loc="upper right", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel("allocation events in one training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
