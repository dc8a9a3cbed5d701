"""What kernels allocate beyond their outputs (sim/kernel_memory.py), as the tracker counts it.

The rules were measured on an H100 (docs/CUDA.md): there, a training step's requested peak is
the plan's to 0.04 MiB once they are counted. Here, without a GPU: logsumexp's temporary
against the CPU allocator's own count (the same kernel code runs on every device), and the
workspace rule (which threads keep which workspace) on real autograd, with sizes of our own.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from sim.hardware import PROFILES_ENV
from sim.kernel_memory import MatmulWorkspaces
from sim.memory import MemoryTracker
from sim.memory_witness import AllocatorWitness
from zerofunc.plan import Plan, simulate


def test_logsumexp_holds_a_copy_of_its_input_as_the_allocator_does():
    """The step's peak is logsumexp's, over fp32 logits of 96 rows. The allocator then holds z - max
    (a copy of z), the result, and the max of each row; the tracker counts the copy and the result.
    The row maxima (rows x 4 B) it does not model; ATen also makes |max| and its == inf mask (rows x
    4 B and rows x 1 B) just before, freed before the copy: at most 9 B a row between them, never
    below 0. Counting no copy would put the tracker 384,000 B short."""
    rows, vocab = 96, 1000
    z = torch.randn(rows, vocab)
    tracker = MemoryTracker()
    with AllocatorWitness() as witness:
        witness.measure("logsumexp", lambda: torch.logsumexp(z, dim=-1), tracker)
    m = witness.steps["logsumexp"]
    assert 0 <= m.allocator_peak - m.tracker_peak <= 9 * rows, (m.allocator_peak, m.tracker_peak)
    assert m.tracker_peak >= z.nbytes


def _trained_once(workspaces: MatmulWorkspaces, recompute: bool) -> MemoryTracker:
    layer = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8, bias=False))
    x = torch.randn(4, 8, requires_grad=True)
    tracker = MemoryTracker(workspaces=workspaces)
    with tracker:
        y = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        y.sum().backward()
    return tracker


@pytest.mark.parametrize("recompute", [False, True])
def test_a_step_keeps_a_workspace_per_thread_and_cublaslt_where_a_bias_is_fused(recompute):
    """Forward's matmuls run on the caller's thread, backward's on autograd's: two cuBLAS workspaces
    from the step's first matmul (from the last step, in a run). The forward's biased linear keeps
    cuBLASLt's on the caller's thread; backward's matmuls carry no bias, unless a checkpointed
    forward is recomputed there (on autograd's thread: a second)."""
    sizes = MatmulWorkspaces(cublas=1 << 20, cublaslt=1 << 12)
    with_them = _trained_once(sizes, recompute).live["other"]
    without = _trained_once(MatmulWorkspaces(), recompute).live["other"]
    assert with_them - without == 2 * sizes.cublas + (2 if recompute else 1) * sizes.cublaslt


def test_a_plan_counts_its_profiles_workspaces_from_the_first_matmul(tmp_path, monkeypatch):
    """gpt2-tiny planned on the CPU profile, then on the same profile given workspaces: every byte of
    the two threads' cuBLAS workspaces and the forward's cuBLASLt one is in the peak (which comes
    after the first matmul), and nothing else moves."""
    plan = Plan(world_size=2, stage=3, model="gpt2-tiny", precision="fp32", micro_batch=2, seq=32, hardware="cpu-gloo")
    bare = simulate(plan, timing=False).memory.peak
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"cpu-gloo": {"matmul_workspace": {"cublas": 3 << 20, "cublaslt": 5 << 10}}}))
    monkeypatch.setenv(PROFILES_ENV, str(path))
    assert simulate(plan, timing=False).memory.peak - bare == 2 * (3 << 20) + (5 << 10)
