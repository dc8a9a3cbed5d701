"""python -m zerofunc.check --calibrate: the rates a GPU sustains, measured, for its hardware profile
(written to the user's profiles file, which overrides the shipped profile by name: sim/hardware.py).

Published peaks overstate what a step gets: an H200 is sold at 989 dense bf16 TFLOP/s
and 4.8 TB/s, and a large bf16 matmul on random data measures nearer 800 TFLOP/s, a
device copy nearer 4.3 TB/s (DESIGN.md). The planner's roofline should use what the
device does. Each figure is the median of timed repetitions, by CUDA events.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

MATMUL_N = 8192            # square matmuls large enough to be compute-bound on any current GPU
COPY_BYTES = 2 * 2**30     # a device copy large enough to stream from HBM, not from L2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cuda_median_s(fn: Callable[[], None], warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of one call of `fn`, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_median_s(fn: Callable[[], None], warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of one call of `fn`, by the wall clock (on a CPU, where a call ends when it returns)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_rate(dtype: torch.dtype, device: torch.device) -> float:
    a, b = (torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=dtype) for _ in range(2))
    return 2 * MATMUL_N**3 / cuda_median_s(lambda: torch.mm(a, b))


def _copy_bandwidth(device: torch.device) -> float:
    src = torch.empty(COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / cuda_median_s(lambda: dst.copy_(src))  # read once, written once


def measure(device: torch.device) -> dict:
    """Matmul FLOP/s per dtype (torch's defaults: fp32 without TF32), copy bandwidth, and total memory."""
    flops = {name: _matmul_rate(dtype, device) for name, dtype in DTYPES.items()}
    bandwidth = _copy_bandwidth(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    return {"flops": flops, "memory_bandwidth": bandwidth, "memory_gib": round(total / 2**30, 2)}
