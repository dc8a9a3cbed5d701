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
* compute_efficiency: the fp32 FLOP/s of `F.linear` forward and backward (6 * tokens * in
  * out FLOP) at a transformer's shapes (1024 tokens; d x 3d, d x 4d, 4d x d for d = 512,
  768, 1024), both ranks at once, median of 5 repeats per shape; per shape the slower rank,
  over shapes the median, divided by flops["fp32"]: the fraction of the square-mm rate a
  step's matmuls reach.
* memory_bandwidth: `torch.add(a, b, out=c)` on 64 MiB fp32 tensors, counting
  3 x 64 MiB read+written per call; median over 10 repeats per rank, slower rank reported.
* op_overhead_s: seconds per op of a chain of one-element multiplies, forward and
  backward through autograd: what every op of a step costs beyond its FLOPs and bytes.
* overlap_hidden: the fraction of an asynchronous 16 MiB all-reduce that hides behind
  matmuls running meanwhile on the same rank, (compute + comm - both) / min of the two,
  the matmuls sized to take about as long as the all-reduce (medians of 7 repeats).
* link: ring alpha-beta model fitted to gloo all_gather (`dist.all_gather_single`),
  reduce_scatter (`dist.reduce_scatter_single`) and all_reduce on 2 ranks, fp32 payloads
  S = 4 KiB to 64 MiB (S = all-gather output, reduce-scatter input, all-reduce buffer); and
  broadcast, as an all-gather is issued by broadcasts: every rank broadcasting its S/n slot
  at once, the time divided by n, each broadcast counted as one of S/n bytes. Each
  repeat: `dist.barrier()`, time the op; the repeat's time is the max over ranks; median
  over the repeats (40 for S <= 4 MiB, 8 above) after 3 warm-ups;
  `measured.collective_spread_s` gives min / p25 / p75 / max as well.
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
         cpu-gloo profile of the user's profiles file, which every plan and run for this machine
         reads over the shipped one: --profiles FILE, default $ZEROFUNC_PROFILES, else
         ~/.config/zerofunc/profiles.json; the package's sim/profiles.json is never written)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cpu_probes import COMM_SIZES, MM_DTYPES, NPROC, OPS, rank_work  # noqa: E402  (beside this script)
from zerofunc.launch import spawn  # noqa: E402


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


def main(raw: bool = False, record: bool = False) -> int:
    """Measure, print the JSON, and with `record` write the figures to the user's profiles file."""
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    results = spawn(rank_work, NPROC)
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

    linear = {shape: min(r["linear"][shape] for r in results) for shape in results[0]["linear"]}
    efficiency = statistics.median(linear.values()) / flops["fp32"]

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
            if op == "broadcast":  # n broadcasts of S/n bytes each: the time of one
                per_rep, size = [t / n for t in per_rep], size // n  # noqa: PLW2901
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
        "compute_efficiency": efficiency,
        "memory_bandwidth": mem_bw,
        "op_overhead_s": max(r["op_overhead_s"] for r in results),
        "overlap_hidden": results[0]["overlap"]["hidden"],  # its times are already the max over ranks
        "link": {"alpha_s": joint["alpha_s"], "bandwidth": joint["bandwidth"],
                 "op_bandwidth": {op: fit["bandwidth"] for op, fit in per_op.items()},
                 "op_seconds": {op: [[_coeffs(op, n)[1] * int(size), t] for size, t in comm_median[op].items()]
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
            "linear_flops": linear,
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
        try:
            where = record_profile(profile, f"benchmarks/measure_cpu_profile.py --record, {time.strftime('%Y-%m-%d')}, "
                                   f"torch {torch.__version__}, load {load_before:.2f} before")
        except OSError as e:
            print(f"error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
            return 2
        except ValueError as e:  # figures the planner could not load: the JSON above still has them
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"[measure] recorded into {where}", file=sys.stderr)
    return 0


def record_profile(profile: dict, source: str):
    """Write what the planner reads of a measured `profile` into the cpu-gloo profile of the user's
    profiles file (sim.hardware.user_path): the package's own profiles.json is never written."""
    from sim.hardware import record_measured
    figures = {"flops": profile["flops"], "compute_efficiency": profile["compute_efficiency"],
               "memory_bandwidth": profile["memory_bandwidth"], "intra_node": profile["link"],
               "inter_node": profile["link"], "op_overhead_s": profile["op_overhead_s"],
               "overlap_hidden": profile["overlap_hidden"]}
    return record_measured("cpu-gloo", figures, source)


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/measure_cpu_profile.py",
                                description="Measure this CPU as a 2-rank gloo machine; print the profile as JSON.")
    p.add_argument("--raw", action="store_true", help="keep every repeat's time per rank in `measured`")
    p.add_argument("--record", action="store_true",
                   help="also write the figures into the cpu-gloo profile of the user's profiles file")
    p.add_argument("--profiles", metavar="FILE", default=None,
                   help="the profiles file --record writes, created if absent (default: $ZEROFUNC_PROFILES, else "
                        "$XDG_CONFIG_HOME/zerofunc/profiles.json)")
    a = p.parse_args(argv)
    from sim.hardware import use_profiles
    try:  # a file that cannot be used is told before a minute of measuring, in one line
        use_profiles(a.profiles, must_exist=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return main(raw=a.raw, record=a.record)


if __name__ == "__main__":
    sys.exit(cli())
