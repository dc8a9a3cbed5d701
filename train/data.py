"""Training data: bytes, with a byte vocabulary (256 tokens).

The built-in corpus is the running Python's own standard-library sources: real text
that is on every machine, so nothing is downloaded. Batches are drawn per *global*
batch from (seed, step), and a rank takes its rows of it, so runs with different
rank counts but the same global batch see the same data, step for step.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

STDLIB_CAP_BYTES = 16 << 20  # enough text for any CPU run; reading all of it takes seconds


class DataError(ValueError):
    """The data cannot be used; the message says why in one line."""


def stdlib_corpus(cap: int = STDLIB_CAP_BYTES) -> bytes:
    """The standard library's .py sources in sorted path order, up to `cap` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            chunk = path.read_bytes()
        except OSError:
            continue
        out.append(chunk)
        size += len(chunk)
        if size >= cap:
            break
    return b"".join(out)[:cap]


def load_tokens(path: str | None, seq: int) -> torch.Tensor:
    """The corpus as a uint8 tensor of byte tokens; `path=None` is the built-in corpus."""
    if path is None:
        raw = stdlib_corpus()
        source = "the standard-library corpus"
    else:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"data file {path} does not exist")
        raw = p.read_bytes()
        source = f"data file {path}"
    if len(raw) == 0:
        raise DataError(f"{source} is empty")
    if len(raw) < seq + 1:
        raise DataError(f"{source} has {len(raw)} bytes, fewer than one sequence of {seq} + 1")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def global_batch_starts(n_tokens: int, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Start offsets of the global batch at `step`: a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_tokens - seq, (batch,), generator=gen)


def rank_batch(tokens: torch.Tensor, step: int, micro_batch: int, world_size: int, rank: int,
               seq: int, seed: int, grad_accum: int = 1, micro_step: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets, sample ids) for one micro-step of the global batch.

    The global batch holds micro_batch x world_size x grad_accum rows; micro-step j of
    rank r takes micro-batch j * world_size + r. A sample id names a row of the global
    batch of a run, (seed, step, row), whatever the rank count; per-sample randomness
    such as dropout is seeded from it.
    """
    size = micro_batch * world_size * grad_accum
    starts = global_batch_starts(len(tokens), step, size, seq, seed)
    lo = (micro_step * world_size + rank) * micro_batch
    hi = lo + micro_batch
    rows = torch.stack([tokens[s:s + seq + 1] for s in starts[lo:hi].tolist()]).long()
    ids = (seed << 40) + (step - 1) * size + torch.arange(lo, hi)
    return rows[:, :-1], rows[:, 1:], ids
