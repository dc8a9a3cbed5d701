"""What each rank of benchmarks/measure_cpu_profile.py measures, with the other rank doing the
same at the same time (training runs 2 ranks on 2 cores): matmul rates, memory bandwidth,
gloo's collectives by size, the overhead per op, and how much communication hides behind
compute. The module docstring of measure_cpu_profile.py says how each is measured and fitted.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from zerofunc.comm import all_gather_single, reduce_scatter_single

NPROC = 2
MM_SIZES = (512, 1024, 2048)
MM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MM_REPEATS = 5
MM_MIN_REPEAT_S = 0.05      # one timed repeat loops mm calls for at least this long
MM_POINT_BUDGET_S = 4.0     # cap on timed time per (dtype, n)
MM_SKIP_CALL_S = 3.0        # a single call slower than this: skip this and larger n
BW_BYTES = 64 << 20
BW_REPEATS = 10
# gloo's all-gather falls off a cliff between 16 and 64 MiB; a block of a 30M-120M GPT is 20-28 MB
COMM_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 24 << 20, 32 << 20, 48 << 20, 64 << 20)
COMM_WARMUP = 3
# Small payloads get more repeats: on this 2-core VM their times are bimodal (~0.2-0.4 ms,
# or ~3.5-4 ms, one 250 Hz scheduler tick, for 20-50% of calls), so a handful of samples
# leaves the median at the mercy of that tail.
COMM_REPEATS_SMALL = 40
COMM_REPEATS_LARGE = 8
# "broadcast": as an all-gather is issued by broadcasts, every rank broadcasting its slot of the
# S-byte buffer at once; the time is of the whole gather (measure_cpu_profile.py divides it by n).
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
# A linear layer's forward and backward at a transformer's shapes (tokens, in, out), for the
# rate a step's matmuls reach: widths of the GPT-2 family's smaller members, 1024 tokens.
LINEAR_SHAPES = tuple((1024, d_in, d_out) for d in (512, 768, 1024)
                      for d_in, d_out in ((d, 3 * d), (d, 4 * d), (4 * d, d)))



def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[measure] {msg}", file=sys.stderr, flush=True)


def _agree_max(x: float) -> float:
    """Max of x over ranks, so every rank takes the same decisions."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _measure_matmul() -> dict:
    out: dict = {}
    for name, dtype in MM_DTYPES.items():
        per_n: dict = {}
        skip = False
        for n in MM_SIZES:
            if skip:
                per_n[str(n)] = {"skipped": True}
                continue
            g = torch.Generator().manual_seed(1234 + n)
            a = torch.randn(n, n, generator=g).to(dtype)
            b = torch.randn(n, n, generator=g).to(dtype)
            c = torch.empty(n, n, dtype=dtype)
            dist.barrier()
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)  # warm-up (also picks the kernel)
            call_s = _agree_max(time.perf_counter() - t0)
            if call_s > MM_SKIP_CALL_S:
                per_n[str(n)] = {"skipped": True, "warmup_call_s": call_s}
                skip = True
                continue
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)  # second warm-up: its time (no one-off setup) sizes the loop
            call_s = _agree_max(time.perf_counter() - t0)
            inner = max(1, int(MM_MIN_REPEAT_S / max(call_s, 1e-6)))
            reps = MM_REPEATS
            if call_s * inner * reps > MM_POINT_BUDGET_S:
                reps = max(3, int(MM_POINT_BUDGET_S / (call_s * inner)))
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    torch.mm(a, b, out=c)
                times.append((time.perf_counter() - t0) / inner)
            med = statistics.median(times)
            per_n[str(n)] = {"median_s": med, "flops": 2.0 * n ** 3 / med, "repeats": reps,
                             "calls_per_repeat": inner, "times_s": times}
            _log(f"mm {name} n={n}: {2.0 * n ** 3 / med / 1e9:.2f} GFLOP/s (rank 0)")
            if call_s * 8 > MM_SKIP_CALL_S:  # next n is 8x the work: would be too slow
                skip = True
        out[name] = per_n
    return out


def _measure_bandwidth() -> dict:
    numel = BW_BYTES // 4
    a = torch.rand(numel)
    b = torch.rand(numel)
    c = torch.empty(numel)
    for _ in range(2):
        torch.add(a, b, out=c)
    times = []
    for _ in range(BW_REPEATS):
        dist.barrier()
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    _log(f"add 64 MiB: {3 * BW_BYTES / med / 1e9:.2f} GB/s (rank 0)")
    return {"tensor_bytes": BW_BYTES, "bytes_per_call": 3 * BW_BYTES, "median_s": med,
            "bandwidth": 3 * BW_BYTES / med, "times_s": times}


def _measure_comm() -> dict:
    world = dist.get_world_size()
    out: dict = {}
    for op in OPS:
        per_size: dict = {}
        for size in COMM_SIZES:
            numel = size // 4
            shard = numel // world
            if op == "all_gather":
                inp, buf = torch.rand(shard), torch.empty(numel)
                fn = lambda: all_gather_single(buf, inp)  # noqa: E731
            elif op == "broadcast":
                buf = torch.rand(numel)
                slots = buf.view(world, -1)
                fn = lambda: [w.wait() for w in [dist.broadcast(slots[r], src=r, async_op=True)  # noqa: E731
                                                 for r in range(world)]]
            elif op == "reduce_scatter":
                inp, buf = torch.rand(numel), torch.empty(shard)
                fn = lambda: reduce_scatter_single(buf, inp, op=dist.ReduceOp.SUM)  # noqa: E731
            else:
                buf = torch.rand(numel)
                fn = lambda: dist.all_reduce(buf)  # noqa: E731
            reps = COMM_REPEATS_SMALL if size <= (4 << 20) else COMM_REPEATS_LARGE
            for _ in range(COMM_WARMUP):
                dist.barrier()
                fn()
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            per_size[str(size)] = times
            _log(f"{op} S={size}: {statistics.median(times) * 1e3:.3f} ms (rank 0)")
        out[op] = per_size
    return out


def _measure_linear(repeats: int = 5) -> dict:
    """fp32 FLOP/s of `F.linear` forward and backward through autograd (6 * tokens * in * out
    FLOP), per shape of LINEAR_SHAPES, both ranks at once: what a training step's matmuls reach,
    against the square `torch.mm` of `flops` (narrower inner dimensions, transposed operands
    in backward, and the other rank's traffic on the shared memory)."""
    rates = {}
    for tokens, d_in, d_out in LINEAR_SHAPES:
        x = torch.rand(tokens, d_in, requires_grad=True)
        w = torch.rand(d_out, d_in, requires_grad=True)
        b = torch.rand(d_out, requires_grad=True)
        g = torch.rand(tokens, d_out)
        times = []
        for _ in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w, b).backward(g)
            times.append(time.perf_counter() - t0)
        rates[f"{tokens}x{d_in}x{d_out}"] = 6 * tokens * d_in * d_out / statistics.median(times[2:])
    _log(f"linear fwd+bwd: median {statistics.median(rates.values()) / 1e9:.1f} GFLOP/s, {len(rates)} shapes (rank 0)")
    return rates


def _measure_op_overhead(chain: int = 200, repeats: int = 9) -> float:
    """Seconds per op of a training step's smallest ops: a chain of multiplies of one element,
    forward and backward through autograd, so that only the dispatch and autograd's bookkeeping
    remain; per op of either pass."""
    x = torch.ones(1, requires_grad=True)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.backward()
        times.append((time.perf_counter() - t0) / (2 * chain))
    med = statistics.median(times[2:])
    _log(f"op overhead: {med * 1e6:.1f} us (rank 0)")
    return med


def _measure_overlap(payload: int = 16 << 20, repeats: int = 9) -> dict:
    """How much of an asynchronous all-reduce hides behind matmuls that run meanwhile on the same
    rank: (compute + comm - both) / min(compute, comm), 1 when it hides completely, 0 when the two
    take as long as one after the other (on CPU both want the rank's one core). The compute is
    sized to take about as long as the all-reduce: a much longer one would leave the fraction to
    the noise of its own time."""
    buf, a = torch.rand(payload // 4), torch.rand(512, 512)

    def timed(fn) -> float:
        ts = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(_agree_max(time.perf_counter() - t0))
        return statistics.median(ts[2:])

    t_comm, t_mm = timed(lambda: dist.all_reduce(buf)), timed(lambda: torch.mm(a, a))
    calls = max(1, round(t_comm / t_mm))

    def compute():
        for _ in range(calls):
            torch.mm(a, a)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_compute, t_comm, t_both = timed(compute), timed(lambda: dist.all_reduce(buf)), timed(both)
    hidden = (t_compute + t_comm - t_both) / min(t_compute, t_comm)
    _log(f"overlap: compute {t_compute * 1e3:.1f} ms, all-reduce {t_comm * 1e3:.1f} ms, both {t_both * 1e3:.1f} ms: "
         f"{hidden:.2f} hidden")
    return {"compute_s": t_compute, "comm_s": t_comm, "both_s": t_both, "hidden": min(1.0, max(0.0, hidden))}


def rank_work() -> dict:
    torch.set_num_threads(1)
    _log(f"world={dist.get_world_size()} backend={dist.get_backend()} threads={torch.get_num_threads()}")
    return {"rank": dist.get_rank(), "matmul": _measure_matmul(),
            "bandwidth": _measure_bandwidth(), "comm": _measure_comm(), "linear": _measure_linear(),
            "op_overhead_s": _measure_op_overhead(), "overlap": _measure_overlap()}
