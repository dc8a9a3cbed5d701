"""What one op costs on a GPU, by its class, from published constants (a profile's `kernels`).

A GPU does not run every op at one fraction of its peak. The planner prices four classes apart:

- GEMMs (mm, addmm, bmm, baddbmm) at peak x the architecture's best achievable fraction (`gemm_ceiling`,
  the brute-force maximum over shapes) x the tile and wave quantization of this shape: the output is cut
  into tiles of the kernel's size, the tiles run in waves of one per SM, and the last wave's idle SMs and
  the tiles' padding are paid for (NVIDIA's Matrix Multiplication Background guide, sections 2.3 and 3).
- Attention (the fused SDPA kernels, forward and backward) at the FLOPs it executes, which under a causal
  mask is about half of what torch's formula counts (torch/utils/flop_counter.py counts the full square),
  and the architecture's flash efficiency, forward and backward apart.
- Everything else by its bytes, at the memory bandwidth x an efficiency that grows with the bytes moved
  (small transfers do not reach the sustained rate), and any FLOPs it has at `compute_efficiency`.
- No kernel is quicker than the launch floor (`floor_s`).

Each op takes the longest of its compute time, its memory time and the floor. The constants and their
sources live in sim/profiles.json; a profile without `kernels` (the CPU's, measured whole) keeps the
single roofline of sim.roofline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The aten ops of these names that this torch has (the oldest supported, 2.11, has them all today)."""
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


GEMMS = _ops("mm", "addmm", "bmm", "baddbmm", "_addmm_activation")
ATTENTION_FORWARD = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
ATTENTION_BACKWARD = _ops("_scaled_dot_product_flash_attention_backward",
                          "_scaled_dot_product_efficient_attention_backward",
                          "_scaled_dot_product_flash_attention_for_cpu_backward",
                          "_scaled_dot_product_cudnn_attention_backward")
# ops that allocate or rebind storage and launch no kernel
NO_KERNEL = _ops("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "set_")
# what bounds an op's time: its class's compute, its bytes, or the launch floor; "none": no kernel;
# "roofline": a profile without kernel costs (one roofline for every op)
BOUNDS = ("roofline", "gemm", "attention", "compute", "memory", "floor", "none")
FIELDS = ("gemm_ceiling", "sms", "gemm_tile", "attention_forward", "attention_backward", "memory_efficiency",
          "floor_s")


@dataclass(frozen=True)
class KernelCosts:
    gemm_ceiling: float                 # the best bf16 GEMM reaches this fraction of dense peak
    sms: int                            # streaming multiprocessors: one tile each per wave
    gemm_tile: tuple[int, int]          # the output tile of the large-GEMM kernels (either way round)
    attention_forward: float            # flash attention's fraction of peak at the FLOPs it executes
    attention_backward: float
    memory_efficiency: tuple[tuple[float, float], ...]  # (bytes moved at least, fraction of bandwidth), descending
    floor_s: float                      # the shortest kernel: launch and tail

    def __post_init__(self) -> None:
        fractions = (self.gemm_ceiling, self.attention_forward, self.attention_backward,
                     *(e for _, e in self.memory_efficiency))
        if not all(0 < f <= 1 for f in fractions) or self.sms < 1 or min(self.gemm_tile) < 1 or self.floor_s < 0:
            raise ValueError(f"kernel costs need fractions in (0, 1], sms and tiles >= 1, floor >= 0: got {self}")
        sizes = [s for s, _ in self.memory_efficiency]
        if not sizes or sizes != sorted(sizes, reverse=True) or sizes[-1] != 0:
            raise ValueError(f"memory_efficiency needs (bytes, fraction) pairs in descending bytes down to 0, "
                             f"got {self.memory_efficiency}")

    @classmethod
    def from_json(cls, raw: dict) -> "KernelCosts":
        unknown, missing = sorted(set(raw) - set(FIELDS)), [k for k in FIELDS if k not in raw]
        if unknown or missing:
            raise ValueError(f"kernels: unknown field(s) {', '.join(unknown) or '-'}, missing {', '.join(missing) or '-'}"
                             f"; the fields are {', '.join(FIELDS)}")
        return cls(raw["gemm_ceiling"], int(raw["sms"]), tuple(raw["gemm_tile"]), raw["attention_forward"],
                   raw["attention_backward"], tuple((float(s), float(e)) for s, e in raw["memory_efficiency"]),
                   raw["floor_s"])

    def wave_efficiency(self, batch: int, m: int, n: int) -> float:
        """The fraction of the SMs' tile work that is useful, for `batch` outputs of m x n: tiles padded to
        the tile size, and the last wave's idle SMs; the better orientation of the tile. An output narrower
        than the tile's short side (a LoRA adapter's rank-8 product) is not cut into these tiles: cuBLAS
        runs it as a skinny kernel, bound by its bytes, so it is priced at the ceiling and its bytes decide."""
        if min(m, n) < min(self.gemm_tile):
            return 1.0

        def useful(tm: int, tn: int) -> float:
            tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
            return batch * m * n / (math.ceil(tiles / self.sms) * self.sms * tm * tn)
        tm, tn = self.gemm_tile
        return max(useful(tm, tn), useful(tn, tm))

    def memory_fraction(self, nbytes: float) -> float:
        return next(e for at_least, e in self.memory_efficiency if nbytes >= at_least)

    def op_seconds(self, func, args, kwargs, out, flops: int, nbytes: int, peak: float, compute_efficiency: float,
                   bandwidth: float) -> tuple[float, str]:
        """Seconds for one op on the device, and what bounds them ("gemm", "attention", "compute", "memory",
        "floor"): `flops` as torch's formula counts them, `nbytes` read and written, `peak` the dense FLOP/s of
        its dtype."""
        packet = func._overloadpacket
        if packet in NO_KERNEL:
            return 0.0, "none"
        memory_s = nbytes / (bandwidth * self.memory_fraction(nbytes)) if nbytes else 0.0
        if packet in GEMMS and flops:
            shape = out.shape
            batch, (m, n) = (shape[0] if len(shape) == 3 else 1), shape[-2:]
            compute_s, kind = flops / (peak * self.gemm_ceiling * self.wave_efficiency(batch, m, n)), "gemm"
        elif packet in ATTENTION_FORWARD or packet in ATTENTION_BACKWARD:
            efficiency = self.attention_forward if packet in ATTENTION_FORWARD else self.attention_backward
            compute_s, kind = flops * causal_fraction(func, args, kwargs) / (peak * efficiency), "attention"
        else:
            compute_s, kind = flops / (peak * compute_efficiency), "compute"
        return max((compute_s, kind), (memory_s, "memory"), (self.floor_s, "floor"))


def _argument(func, args, kwargs, name: str, default=None):
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else (kwargs or {}).get(name, default)
    return default


def causal_fraction(func, args, kwargs) -> float:
    """The fraction of torch's counted attention FLOPs a kernel executes: under a causal mask, query i
    attends to keys 0..i, (T + 1) / 2T of the T x T square (a flash kernel also computes the masked half
    of the tiles on the diagonal: 1/128 more at T = 8192, left out)."""
    if not _argument(func, args, kwargs, "is_causal", False):
        return 1.0
    query = _argument(func, args, kwargs, "query")
    t = query.shape[-2]
    return (t + 1) / (2 * t)
