"""Where a zerofunc step's wall time goes, phase by phase, without a profiler: forward, backward and the
update, eager (`zerofunc-S`) or compiled whole (`zerofunc-whole-S`: its forward graph, its backward, the
reduce graph and the update's graph), timed with `time.perf_counter` around each call.

    python benchmarks/step_phases.py zerofunc-2 zerofunc-whole-2 [--model 120m] [--steps 3]
                                     [--activation-checkpointing full] [--faults]

Each row is one of benchmarks/peers.py's (2 gloo ranks, one thread each, as there), run for its own steps
and then `--steps` more, timed; milliseconds per step, mean over those, for each rank. The update is
entered behind a `dist.barrier()`, timed apart, so that the ranks' skew shows there and not in the
update. Why not torch.profiler (benchmarks/step_profile.py): on this CPU it inflates the compiled
update's graph about threefold (issue 31's ninth step, docs/BENCHMARKS.md), so its times say which ops
run, not how long the graph takes. `--faults`: the process's minor page faults per step instead (getrusage,
gloo's threads included), phase by phase: a buffer allocated fresh each step whose pages the allocator
gave back to the kernel is faulted in again, 4 KiB at a time."""
from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers  # noqa: E402
from zerofunc.recompute import MODES  # noqa: E402

PHASES = ("forward", "backward", "reduce", "barrier", "update", "step")


def phase_calls(engine) -> list[tuple[object, str, str]]:
    """The calls a step's phases are, as (owner, attribute, phase): compiled whole, the instance's compiled
    callables and autograd's backward; eager, the engine's forward, backward and update. Patched on their
    owner by whoever measures them (here, and benchmarks/step_memory_cpu.py)."""
    import torch
    whole = engine.whole
    if whole is not None:
        return [(whole, "_loss", "forward"), (torch.Tensor, "backward", "backward"), (whole, "_reduce", "reduce"),
                (whole, "_apply", "update")]
    return [(type(engine), "__call__", "forward"), (engine, "differentiate", "backward"), (engine, "update", "update")]


class Probe:
    """A probe of peers.run_rank: `steps` more steps, each phase's calls timed."""

    def __init__(self, steps: int, faults: bool = False):
        self.steps, self.faults = steps, faults

    def __call__(self, family, engine, train_step, x, y) -> dict:
        import torch.distributed as dist
        spent: dict[str, float] = {}
        # the clock, or the count of minor page faults
        now = (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt) if self.faults else time.perf_counter

        def timed(phase, fn):
            @functools.wraps(fn)
            def run(*args, **kwargs):
                t0 = now()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[phase] = spent.get(phase, 0.0) + now() - t0
            return run

        def behind_barrier(fn):
            def run(*args, **kwargs):
                timed("barrier", dist.barrier)()
                return fn(*args, **kwargs)
            return run

        calls = phase_calls(engine)
        originals = [getattr(owner, name) for owner, name, _ in calls]
        for (owner, name, phase), fn in zip(calls, originals):
            fn = timed(phase, fn)
            setattr(owner, name, behind_barrier(fn) if phase == "update" else fn)
        try:
            t0 = now()
            for _ in range(self.steps):
                train_step(x, y)
            spent["step"] = now() - t0
        finally:  # the classes' own back (what was patched on an instance goes with it)
            for (owner, name, _), fn in zip(calls, originals):
                if isinstance(owner, type):
                    setattr(owner, name, fn)
        return {phase: s / self.steps * (1 if self.faults else 1e3) for phase, s in spent.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("impl", nargs="+", help="zerofunc-S or zerofunc-whole-S rows of benchmarks/peers.py")
    ap.add_argument("--model", default="120m", choices=sorted(peers.MODELS))
    ap.add_argument("--steps", type=int, default=3, help="steps timed, after the run's own (the first compiles)")
    ap.add_argument("--activation-checkpointing", choices=MODES, default="none", help="every row's (zerofunc.recompute)")
    ap.add_argument("--faults", action="store_true", help="minor page faults per step, not milliseconds")
    args = ap.parse_args(argv)
    bad = [i for i in args.impl if i not in peers.IMPLS or peers.IMPLS[i][0] not in ("zerofunc", "zerofunc-whole")]
    if bad:
        ap.error(f"not a zerofunc row of benchmarks/peers.py: {', '.join(bad)}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    print(f"model {args.model}, 2 gloo ranks, activation checkpointing {args.activation_checkpointing}, "
          f"{'minor page faults' if args.faults else 'ms'} per step (mean of {args.steps}), rank 0 / rank 1")
    print(f"{'impl':20s}" + "".join(f"{p:>15s}" for p in PHASES))
    for impl in args.impl:
        row = peers.run_impl(impl, args.model, 4, 2, probe=Probe(args.steps, args.faults),
                             checkpointing=args.activation_checkpointing)
        if row["status"] != "ok":
            print(f"{impl}: {row['status']}", file=sys.stderr)
            return 1
        ranks = row["probe"]
        cells = ["/".join(f"{r[p]:.0f}" if p in r else "-" for r in ranks) for p in PHASES]
        print(f"{impl:20s}" + "".join(f"{c:>15s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
