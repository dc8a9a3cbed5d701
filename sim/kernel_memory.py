"""Memory a kernel allocates beyond its outputs: what a count of tensors misses, and the memory
tracker adds (sim.memory).

Measured on an H100 and an H200 with torch 2.11, gpt2-small, by the allocator's own trace and the
allocator's peak during each op (benchmarks/cuda_memory_snapshot.py; figures in docs/CUDA.md):

- Matmul workspaces. PyTorch gives each thread its own cuBLAS handle, and each handle a
  workspace at its first matmul, kept for the life of the process. A training step runs its
  forward's matmuls on the calling thread and backward's (recomputed forwards included) on
  autograd's device thread, so from the second step on it holds two, before it begins. The size
  is PyTorch's default CUBLAS_WORKSPACE_CONFIG (CublasHandlePool.cpp): 32 MiB on sm_90 and later,
  8 MiB + 128 KiB before. A matmul with a fused bias (addmm with a 1-D bias: cuBLASLt's epilogue)
  keeps cuBLASLt's own workspace, 1 MiB, on its thread. A profile gives both sizes
  (`matmul_workspace`); a CPU's are 0.
- Temporaries, freed before the op returns. `aten.logsumexp` writes x - max(x) into a temporary
  the size of x and exponentiates it in place before it sums (ReduceOps.cpp, every device; on
  CPU the profiler shows the same bytes): for a language model's fp32 loss, one chunk of logits,
  which is where gpt2-small's step peaks. A fused attention backward accumulates dq in fp32 and
  keeps one fp32 statistic per row: 4 bytes per element of q and 4 per row (cuDNN's, measured;
  flash attention 2 allocates the same, by its source, up to rounding T to 128 and D to 32).

Not modelled, seen: CUDA's reductions across rows (a linear's bias gradient, summed over tokens)
stage partial sums in a buffer of up to 4x their input while they run (96 MiB for gpt2-small's
MLP at 4 x 1024 tokens), early in backward, below the step's peak in every model checked; and the
caching allocator's rounding (a block of at least the request, up to 1 MiB more), 0.2-1% of the
peak.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_aten = torch.ops.aten

# The ops that run on cuBLAS (a thread's first one creates its handle's workspace)
MATMULS = frozenset({_aten.mm, _aten.addmm, _aten.addmm_, _aten.bmm, _aten.baddbmm, _aten.baddbmm_,
                     _aten._addmm_activation, _aten.mv, _aten.addmv, _aten.addmv_})
_BIASED = frozenset({_aten.addmm, _aten._addmm_activation})
_ATTENTION_BACKWARD = frozenset({_aten._scaled_dot_product_flash_attention_backward,
                                 _aten._scaled_dot_product_cudnn_attention_backward})


@dataclass(frozen=True)
class MatmulWorkspaces:
    """Bytes of workspace a thread keeps once it has run a matmul (cuBLAS), and once it has run one
    with a fused bias (cuBLASLt)."""

    cublas: int = 0
    cublaslt: int = 0


def temporary_bytes(func, args: tuple) -> int:
    """Bytes `func` allocates for itself while it runs and frees before it returns (0 for most ops)."""
    packet = func.overloadpacket
    if packet is _aten.logsumexp:
        x = args[0]
        return x.numel() * x.element_size()
    if packet in _ATTENTION_BACKWARD:
        q = args[1]  # (grad_out, query, key, value, ...)
        return 4 * q.numel() + 4 * (q.numel() // q.shape[-1])
    return 0


class ThreadWorkspaces:
    """Which workspaces a step's threads hold: "forward" (the caller) and "backward" (autograd's)."""

    def __init__(self, sizes: MatmulWorkspaces):
        self.sizes = sizes
        self.held: set[tuple[str, str]] = set()

    def new(self, func, args: tuple) -> list[int]:
        """The bytes of each workspace `func` makes its thread allocate (those not held yet)."""
        packet = func.overloadpacket
        if packet not in MATMULS or not (self.sizes.cublas or self.sizes.cublaslt):
            return []
        if not self.held:  # the step's first matmul: both threads' handles exist from the last step
            self.held |= {("forward", "cublas"), ("backward", "cublas")}
            out = [self.sizes.cublas, self.sizes.cublas]
        else:
            out = []
        thread = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if packet in _BIASED and args[0].dim() == 1 and (thread, "cublaslt") not in self.held:
            self.held.add((thread, "cublaslt"))
            out.append(self.sizes.cublaslt)
        return [b for b in out if b]
