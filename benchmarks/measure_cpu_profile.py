"""Measure this CPU as a 2-rank gloo machine, one thread per rank, for the planner.

What is measured (all inside one `spawn(..., 2)` run, every rank with
`torch.set_num_threads(1)`, both ranks doing the same work at the same time, since
training runs 2 ranks on 2 cores):

* flops[dtype]: sustained `torch.mm` FLOP/s of ONE rank for fp32, bf16 and fp16 on
  square matrices n = 512, 1024, 2048 (2*n^3 FLOP per call). Per (dtype, n): two warm-up
  calls, then ~5 timed repeats, each repeat a loop of calls lasting >= ~50 ms, started
  after a `dist.barrier()` so both ranks compute concurrently. Per rank the best (over n)
  median is taken; the reported value is the slower rank's (training waits for it).
  A (dtype, n) whose single call is very slow gets fewer repeats, and larger n are
  skipped, so that a slow dtype cannot blow the time budget; what was run is in
  `measured.matmul`.
* memory_bandwidth: `torch.add(a, b, out=c)` on 64 MiB fp32 tensors, counting
  3 x 64 MiB read+written per call; median over 10 repeats per rank, slower rank reported.
* op_overhead_s: seconds per op of a chain of one-element multiplies, forward and
  backward through autograd: what every op of a step costs beyond its FLOPs and bytes.
* overlap_hidden: the fraction of an asynchronous 16 MiB all-reduce that hides behind
  matmuls running meanwhile on the same rank, (compute + comm - both) / min of the two.
* link: ring alpha-beta model fitted to gloo all_gather (`dist.all_gather_single`),
  reduce_scatter (`dist.reduce_scatter_single`) and all_reduce on 2 ranks, fp32 payloads
  S = 4 KiB, 64 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB (S = all-gather output, reduce-scatter
  input, all-reduce buffer). Each repeat: `dist.barrier()`, time the op; the repeat's time
  is the max over ranks; median over the repeats (40 for S <= 4 MiB, 8 above) after 3
  warm-ups; `measured.collective_spread_s` gives min / p25 / p75 / max as well.
  Model with n ranks:  all_gather / reduce_scatter: (n-1)*alpha + (n-1)/n * S / bw;
                       all_reduce: 2(n-1)*alpha + 2(n-1)/n * S / bw.
  t = c1*alpha + c2*S*(1/bw) is linear in (alpha, 1/bw); `link` is the ordinary least
  squares fit over ALL (op, size) points jointly (with alpha clamped at >= 0: if the
  unconstrained fit gives alpha < 0, alpha = 0 and 1/bw is refitted). `measured.fits`
  also holds per-op fits, a relative-error-weighted joint fit, and a joint fit to the
  25th-percentile times (the calls that escaped the ~4 ms scheduler stalls), and
  `measured.joint_fit_rel_error` gives (model - measured) / measured per point.
  Since no line fits gloo (its all-gather is quick up to some tens of MiB, then
  falls off a cliff), `link.op_seconds` keeps the medians themselves, per op, keyed
  by the bytes each rank sends in the ring ((n-1)/n of the payload, twice that for an
  all-reduce): the planner interpolates them, and chooses each collective by them.

Other work on the machine skews everything (2 cores, 2 busy ranks): run it on an idle
machine; `measured.setup.loadavg_1min_before` records the 1-minute load average seen at
the start (a trailing average: a run right after another one sees that one's load).

Prints one JSON object to stdout; progress goes to stderr. Takes about 10-20 s on a 2-core
Xeon.

Usage:  python benchmarks/measure_cpu_profile.py > profile.json
        (add --raw to keep every repeat's time per rank in `measured`;
         --record to also write flops, memory_bandwidth and the links into the
         cpu-gloo profile of sim/profiles.json, which every plan for this machine reads)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerofunc.comm import all_gather_single, reduce_scatter_single  # noqa: E402
from zerofunc.launch import spawn  # noqa: E402

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
OPS = ("all_gather", "reduce_scatter", "all_reduce")



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


def _measure_overlap(payload: int = 16 << 20, repeats: int = 5) -> dict:
    """How much of an asynchronous all-reduce hides behind matmuls that run meanwhile on the same
    rank: (compute + comm - both) / min(compute, comm), 1 when it hides completely, 0 when the two
    take as long as one after the other (on CPU both want the rank's one core)."""
    buf, a = torch.rand(payload // 4), torch.rand(512, 512)

    def compute():
        for _ in range(40):
            torch.mm(a, a)

    def timed(fn) -> float:
        ts = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(_agree_max(time.perf_counter() - t0))
        return statistics.median(ts)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_compute, t_comm, t_both = timed(compute), timed(lambda: dist.all_reduce(buf)), timed(both)
    hidden = (t_compute + t_comm - t_both) / min(t_compute, t_comm)
    _log(f"overlap: compute {t_compute * 1e3:.1f} ms, all-reduce {t_comm * 1e3:.1f} ms, both {t_both * 1e3:.1f} ms: "
         f"{hidden:.2f} hidden")
    return {"compute_s": t_compute, "comm_s": t_comm, "both_s": t_both, "hidden": min(1.0, max(0.0, hidden))}


def _rank_work() -> dict:
    torch.set_num_threads(1)
    _log(f"world={dist.get_world_size()} backend={dist.get_backend()} threads={torch.get_num_threads()}")
    return {"rank": dist.get_rank(), "matmul": _measure_matmul(),
            "bandwidth": _measure_bandwidth(), "comm": _measure_comm(),
            "op_overhead_s": _measure_op_overhead(), "overlap": _measure_overlap()}


# ---------------------------------------------------------------- fitting (parent)

def _coeffs(op: str, n: int) -> tuple[float, float]:
    """(c1, c2) with t = c1*alpha + c2*S/bw."""
    k = 2.0 if op == "all_reduce" else 1.0
    return k * (n - 1), k * (n - 1) / n


def _fit(points: list[tuple[str, int, float]], n: int, relative: bool = False) -> dict:
    rows = np.array([[_coeffs(op, n)[0], _coeffs(op, n)[1] * s] for op, s, _ in points])
    t = np.array([t for _, _, t in points])
    w = 1.0 / t if relative else np.ones_like(t)
    A, y = rows * w[:, None], t * w
    (alpha, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    clamped = False
    if alpha < 0:  # a negative latency is unphysical: fit the bandwidth alone
        clamped, alpha = True, 0.0
        inv_bw = float(A[:, 1] @ y / (A[:, 1] @ A[:, 1]))
    pred = rows @ np.array([alpha, inv_bw])
    rel = (pred - t) / t
    return {"alpha_s": float(alpha), "bandwidth": float(1.0 / inv_bw) if inv_bw > 0 else float("inf"),
            "alpha_clamped_to_zero": clamped, "max_abs_rel_error": float(np.max(np.abs(rel))),
            "rms_rel_error": float(np.sqrt(np.mean(rel ** 2))),
            "_pred": pred, "_rel": rel}


def _public(fit: dict) -> dict:
    return {k: v for k, v in fit.items() if not k.startswith("_")}


def main(raw: bool = False, record: bool = False) -> None:
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    results = spawn(_rank_work, NPROC)
    n = NPROC

    # compute: per rank best median over n, report the slower rank
    matmul_raw, flops = {}, {}
    for name in MM_DTYPES:
        per_rank = []
        for r in results:
            ok = {k: v for k, v in r["matmul"][name].items() if "flops" in v}
            best_n = max(ok, key=lambda k: ok[k]["flops"]) if ok else None
            per_rank.append({"best_n": int(best_n) if best_n else None,
                             "best_flops": ok[best_n]["flops"] if ok else 0.0,
                             "per_n": r["matmul"][name]})
        flops[name] = min(p["best_flops"] for p in per_rank)
        matmul_raw[name] = {f"rank{i}": p for i, p in enumerate(per_rank)}

    bw_raw = {f"rank{i}": r["bandwidth"] for i, r in enumerate(results)}
    mem_bw = min(r["bandwidth"]["bandwidth"] for r in results)

    # comm: per repeat the max over ranks, then the median
    comm_median: dict = {}
    comm_spread: dict = {}
    points_p25: list[tuple[str, int, float]] = []
    points: list[tuple[str, int, float]] = []
    for op in OPS:
        comm_median[op] = {}
        comm_spread[op] = {}
        for size in COMM_SIZES:
            per_rank = [r["comm"][op][str(size)] for r in results]
            per_rep = [max(ts) for ts in zip(*per_rank)]
            med = statistics.median(per_rep)
            comm_median[op][str(size)] = med
            q = np.quantile(per_rep, [0.0, 0.25, 0.75, 1.0])
            comm_spread[op][str(size)] = {"min": float(q[0]), "p25": float(q[1]),
                                          "p75": float(q[2]), "max": float(q[3]), "repeats": len(per_rep)}
            points_p25.append((op, size, float(q[1])))
            points.append((op, size, med))

    joint = _fit(points, n)
    joint_rel = _fit(points, n, relative=True)
    per_op = {op: _public(_fit([p for p in points if p[0] == op], n)) for op in OPS}
    rel_err = {op: {} for op in OPS}
    model_s = {op: {} for op in OPS}
    for (op, size, _), pred, rel in zip(points, joint["_pred"], joint["_rel"]):
        rel_err[op][str(size)] = float(rel)
        model_s[op][str(size)] = float(pred)

    profile = {
        "flops": flops,
        "memory_bandwidth": mem_bw,
        "op_overhead_s": max(r["op_overhead_s"] for r in results),
        "overlap_hidden": results[0]["overlap"]["hidden"],  # its times are already the max over ranks
        "link": {"alpha_s": joint["alpha_s"], "bandwidth": joint["bandwidth"],
                 "op_bandwidth": {op: fit["bandwidth"] for op, fit in per_op.items()},
                 "op_seconds": {op: [[_coeffs(op, n)[1] * size, comm_median[op][str(size)]] for size in COMM_SIZES]
                                for op in OPS},
                 "measured_ranks": n},
        "measured": {
            "setup": {"nproc": n, "backend": "gloo", "threads_per_rank": 1, "torch": torch.__version__,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "loadavg_1min_before": load_before,
                      "note": "flops and memory_bandwidth are per rank with both ranks busy; "
                              "the slower rank's value is reported. Collective times are the max over "
                              "ranks per repeat, median over repeats."},
            "collective_median_s": comm_median,
            "collective_spread_s": comm_spread,
            "collective_payload_bytes": list(COMM_SIZES),
            "joint_fit": _public(joint),
            "joint_fit_model_s": model_s,
            "joint_fit_rel_error": rel_err,
            "fits": {"joint_least_squares": _public(joint),
                     "joint_relative_weighted": _public(joint_rel),
                     "joint_least_squares_p25": _public(_fit(points_p25, n)),
                     "joint_relative_weighted_p25": _public(_fit(points_p25, n, relative=True)),
                     "per_op": per_op},
            "overlap": results[0]["overlap"],
            "matmul": matmul_raw,
            "memory_bandwidth": bw_raw,
            "wall_s": time.perf_counter() - start,
        },
    }
    if raw:
        profile["measured"]["collective_raw_s"] = {f"rank{i}": r["comm"] for i, r in enumerate(results)}
    else:  # drop the per-repeat lists; medians and spreads stay
        for per_rank in list(matmul_raw.values()) + [bw_raw]:
            for entry in per_rank.values():
                entry.pop("times_s", None)
                for v in entry.get("per_n", {}).values():
                    v.pop("times_s", None)
    print(f"[measure] done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    json.dump(profile, sys.stdout, indent=1)
    sys.stdout.write("\n")
    if record:
        from sim.hardware import record_measured
        figures = {"flops": flops, "memory_bandwidth": mem_bw, "intra_node": profile["link"],
                   "inter_node": profile["link"], "op_overhead_s": profile["op_overhead_s"],
                   "overlap_hidden": profile["overlap_hidden"]}
        where = record_measured("cpu-gloo", figures, f"benchmarks/measure_cpu_profile.py --record, "
                                f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, load {load_before:.2f} before")
        print(f"[measure] recorded into {where}", file=sys.stderr)


if __name__ == "__main__":
    main(raw="--raw" in sys.argv[1:], record="--record" in sys.argv[1:])
