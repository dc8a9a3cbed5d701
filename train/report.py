"""What a person watching a run sees: progress on rank 0, a summary at the end, the loss curve."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

GiB = 2**30


class Progress:
    """A progress bar when rank 0 writes to a terminal; otherwise one line per step (for logs)."""

    def __init__(self, first: int, total: int):
        self.bar = tqdm(total=total, initial=first - 1, unit="step", dynamic_ncols=True) if sys.stderr.isatty() else None
        self.total = total
        self.val_loss = None  # the latest evaluation's, shown until the next

    def update(self, step: int, loss: float, tokens_per_s: float, peak_bytes: int,
               val_loss: float | None = None) -> None:
        if val_loss is not None:
            self.val_loss = val_loss
        val = self.val_loss
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", **({"val": f"{val:.4f}"} if val is not None else {}),
                                 tok_s=f"{tokens_per_s:,.0f}", peak=f"{peak_bytes / GiB:.2f} GiB", refresh=False)
            self.bar.update(1)
        else:
            shown = f"  val {val_loss:.4f}" if val_loss is not None else ""
            print(f"step {step:5d}/{self.total}  loss {loss:.4f}{shown}  {tokens_per_s:9.0f} tok/s  "
                  f"peak {peak_bytes / GiB:.3f} GiB", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summary(per_rank: list[dict], steps: int) -> str:
    """The end-of-run summary from every rank's totals (rank order)."""
    r0 = per_rank[0]
    peaks = ", ".join(f"rank {r}: {d['peak_bytes'] / GiB:.3f} GiB" for r, d in enumerate(per_rank))
    lines = [f"done: {steps} steps in {r0['elapsed_s']:.1f} s, {r0['tokens'] / max(r0['elapsed_s'], 1e-9):,.0f} tokens/s, "
             f"final loss {r0['final_loss']:.4f}",
             f"peak memory per rank: {peaks}",
             f"communication: {r0['comm_bytes'] / GiB:.3f} GiB in all, {r0['comm_bytes'] / max(steps, 1) / 2**20:.2f} MiB "
             f"per step (ZeRO-paper volume, per rank)"]
    if r0.get("whole_on_cpu"):  # train/loop.py: the CPU tracker would make the compiled step run eagerly
        lines.append("peak memory (--compile whole on CPU): the engine's buffers, not the compiled step's own; the "
                     "communication is read from the compiled graphs as they ran")
    return "\n".join(lines)


def plot_loss(metrics: Path, png: Path) -> None:
    """The loss curve of a run's metrics.jsonl, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], linewidth=1, label="train")
    evaluated = [r for r in rows if "val_loss" in r]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-", linewidth=1,
                markersize=3, label="validation")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title(f"{metrics.parent.name}: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.partial.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(png)
