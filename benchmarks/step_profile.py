"""Where one training step of a peer harness row spends its time, per rank: torch.profiler over one step after
the run's own (warm, compiled) steps, the ops a step's time goes to (matmuls, copies, collectives and the
waits on them), and each wait on a functional collective in the order the step ran them.

    python benchmarks/step_profile.py zerofunc-whole-3 [--model 30m] [--steps 6]

The row is one of benchmarks/peers.py's (IMPLS there; a wrong name lists them); 2 gloo ranks, one thread
each, as there. The waits are what the compiled step (--compile whole) spends blocked on its collectives;
the eager step's waits are not ops and do not show. Times are the profiler's CPU milliseconds, self time
per op name: which ops run, not how long a compiled graph takes (the profiler inflates the compiled
update's graph about threefold on this project's CPU; benchmarks/step_phases.py times the phases)."""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers  # noqa: E402

SHOWN = ("wait_tensor", "broadcast", "all_reduce", "reduce_scatter", "all_gather", "aten::mm", "aten::addmm",
         "aten::bmm", "aten::copy_", "aten::cat")


def profile_step(family, engine, train_step, x, y) -> dict:
    """A probe of peers.run_rank: one more step, profiled."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        train_step(x, y)
        wall = time.perf_counter() - t0
    ops = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
           if any(s in e.key for s in SHOWN)}
    waits = [e.cpu_time_total / 1e3 for e in prof.events() if e.name == "_c10d_functional::wait_tensor"]
    return {"wall_ms": wall * 1e3, "ops": ops, "waits_ms": waits}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("impl", choices=sorted(peers.IMPLS))
    ap.add_argument("--model", default="30m")
    ap.add_argument("--steps", type=int, default=6, help="steps before the profiled one (the first compiles)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step compiles")
    row = peers.run_impl(args.impl, args.model, args.steps, args.steps // 2, probe=profile_step)
    if row["status"] != "ok":
        print(f"{args.impl}: {row['status']}", file=sys.stderr)
        return 1
    for rank, probe in enumerate(row["probe"]):
        print(f"rank {rank}: profiled step {probe['wall_ms']:.0f} ms")
        for name, (count, ms) in sorted(probe["ops"].items(), key=lambda kv: -kv[1][1]):
            print(f"  {name[:60]:60s} {count:5d} calls {ms:9.1f} ms")
        waits = probe["waits_ms"]
        if waits:
            print(f"  waits on collectives, in order ({sum(waits):.1f} ms): " + " ".join(f"{w:.1f}" for w in waits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
