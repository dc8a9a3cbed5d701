"""--tensorboard DIR: the trainer's metrics rows as TensorBoard scalars, where people look.

metrics.jsonl stays the source of truth; this is a view of the same rows, written by rank 0
as each row is. TensorBoard is an optional extra (`pip install 'zerofunc[tensorboard]'`): the
trainer checks for it before starting any rank (`check`), so that a missing package is one
line and exit 2, not a traceback from a rank.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from zerofunc.usage import UsageError

GiB = 2**30
# a row's key -> its scalar's tag; the derived ones (tokens/s, GiB) are computed in `scalars`
TAGS = {"loss": "loss/train", "val_loss": "loss/val", "lr": "optim/lr", "grad_norm": "optim/grad_norm",
        "loss_scale": "optim/loss_scale", "tokens_per_s": "speed/tokens_per_s", "peak_gib": "memory/peak_gib"}
FLUSH_S = 10  # seconds between flushes to disk: a run is visible while it trains


class TensorBoardError(UsageError):
    """--tensorboard cannot be used: the package is missing, or DIR is not a directory. One line."""


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises it for a missing (or too old) tensorboard package
        raise TensorBoardError("--tensorboard needs the tensorboard package: "
                               "pip install 'zerofunc[tensorboard]'") from None
    return SummaryWriter


def check(log_dir: str | Path) -> None:
    """Raise TensorBoardError unless a log can be opened at `log_dir`: call it before starting ranks."""
    _summary_writer()
    path = Path(log_dir)
    if path.exists() and not path.is_dir():
        raise TensorBoardError(f"--tensorboard {str(log_dir)!r} is a file, not a directory")


def scalars(row: dict) -> dict[str, float]:
    """The scalars of one metrics row, by tag: only those the row has, and numbers only.

    tokens/s is the step's own (tokens per step over its time_s: `tokens` counts every step so far,
    so it is `tokens / step`), not the run's average; peak memory is in GiB."""
    out = {key: row[key] for key in ("loss", "val_loss", "lr", "grad_norm", "loss_scale") if key in row}
    if "tokens" in row and row.get("time_s") and row.get("step"):
        out["tokens_per_s"] = row["tokens"] / row["step"] / row["time_s"]
    if "peak_bytes" in row:
        out["peak_gib"] = row["peak_bytes"] / GiB
    return {TAGS[k]: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLog:
    """Event files under `log_dir`, one scalar per tag per step.

    `first_step`: a resumed run's first step. TensorBoard then hides what an earlier run logged
    at that step and after (those steps run again), as metrics.jsonl drops their rows."""

    def __init__(self, log_dir: str | Path, first_step: int = 1):
        check(log_dir)
        self.writer = _summary_writer()(str(log_dir), purge_step=first_step if first_step > 1 else None,
                                        flush_secs=FLUSH_S)

    def write(self, row: dict, step: Optional[int] = None) -> None:
        """Log the row's scalars at `step` (default: the row's own)."""
        step = row["step"] if step is None else step
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
