"""Test helpers that need nothing beyond torch and zerofunc (no hypothesis), so that the
CUDA tests import on a GPU image where only torch, pytest and the checkout are found."""
from __future__ import annotations

import torch

from zerofunc.launch import spawn
from zerofunc.optim import AdamWConfig

# eps 1e-5, not 1e-8: attention's key bias has an exactly-zero true gradient (softmax
# ignores a constant added to a row of scores), so its computed gradient is 1e-11 to
# 1e-10 of rounding noise whose sign depends on summation order. Adam divides by
# sqrt(v) + eps, so with eps 1e-8 that noise becomes an lr-sized step that differs
# between any two summation orders (one device vs. N ranks); with 1e-6 it still
# reached 1.4e-5 of that bias. 1e-5 stays well below the real gradients here (1e-4 to
# 1e-2), and the gradients are compared directly as well, at 1e-5.
# lr 1e-3 (the trainer's default) for the same reason: where a gradient nearly cancels,
# Adam turns summation-order rounding into lr/eps times as much update. At lr 1e-2 with
# 12 accumulated micro-batches a wte element reached 1.5e-5; a wrong update still
# shows at lr 1e-3, two orders of magnitude above the tolerance.
OPTIM = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)

GUARD = 37.0  # fills the memory just past a buffer's end: a kernel that ignores its tail mask overwrites it
GUARD_ELEMENTS = 1024


def _one_thread(fn, *args):
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    return fn(*args)


def in_world(world_size: int, fn, *args, backend: str = "gloo"):
    """Run `fn(*args)` on `world_size` ranks of `backend`; the list of their results."""
    return spawn(_one_thread, world_size, fn, *args, backend=backend, timeout=600)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of `a` against `b`."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def guarded(n: int, dtype: torch.dtype, fill=None, device: str | torch.device = "cpu"):
    """A flat tensor of n elements followed, in the same storage, by a guard block of GUARD."""
    store = torch.full((n + GUARD_ELEMENTS,), GUARD, dtype=dtype, device=device)
    if fill is not None:
        store[:n] = fill
    return store[:n], store[n:]


def close(ours: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, float]:
    """Within 1e-6 of max(1, max|ref|): a few ulps of fp32 (tests/test_kernels.py says why)."""
    diff = (ours - ref).abs().max().item()
    tol = 1e-6 * max(1.0, ref.abs().max().item())
    return diff <= tol, diff, tol
