"""Two or more of peers.py's implementations, interleaved, with where each step's time goes.

Each variant is one of `benchmarks/peers.py`'s implementations (same model, data, seed
and optimizer), optionally with zerofunc's all-gathers forced to one op
(`zerofunc-3:broadcast`, `:all_reduce` or `:all_gather`) in place of the op gloo's
measured rates choose. Per variant it prints the median step time over the runs, and
per step (rank 0's, averaged over every step, warm-up included): the seconds zerofunc
spent in a collective's `wait()` (communication not hidden; 0 for peers, which are not
instrumented) and the CPU seconds of the whole rank process (compute, plus the threads
gloo copies in).

Usage: python benchmarks/ab.py --model 30m --repeat 5 zerofunc-1 zero-redundancy-opt
       python benchmarks/ab.py --model 30m zerofunc-0 zerofunc-3:broadcast zerofunc-3:all_gather
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import peers  # noqa: E402

GATHER_OPS = ("broadcast", "all_reduce", "all_gather")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_rank(gather_op, impl: str, model: str, steps: int, warmup: int) -> dict:
    """One rank of peers.run_rank, with gathers forced to `gather_op` (None: as chosen) and waits timed."""
    import zerofunc.comm as comm
    if gather_op is not None:
        comm.Communicator.gather_op = lambda self, out: gather_op
    waits, wait = [], comm._Staged.wait

    def timed_wait(handle):
        t = time.perf_counter()
        wait(handle)
        waits.append(time.perf_counter() - t)
    comm._Staged.wait = timed_wait
    cpu = _cpu_s()
    out = peers.run_rank(impl, model, steps, warmup)
    return out | {"cpu_s": (_cpu_s() - cpu) / steps, "wait_s": sum(waits) / steps}


def parse_variant(text: str, ap: argparse.ArgumentParser) -> tuple[str, str | None]:
    impl, _, op = text.partition(":")
    if impl not in peers.IMPLS:
        ap.error(f"unknown implementation {impl!r}; peers.py has {', '.join(peers.IMPLS)}")
    if op and (op not in GATHER_OPS or not impl.startswith("zerofunc-")):
        ap.error(f"{text!r}: only a zerofunc variant takes a gather op, one of {', '.join(GATHER_OPS)}")
    return impl, op or None


def label(impl: str, op: str | None) -> str:
    return f"{impl}:{op}" if op else impl


def main(argv=None) -> int:
    from zerofunc.launch import RankError, spawn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="impl or zerofunc-S:gather_op, as many as wanted")
    ap.add_argument("--model", choices=sorted(peers.MODELS), default="30m")
    ap.add_argument("--repeat", type=int, default=5, help="runs per variant, interleaved (default 5)")
    args = ap.parse_args(argv)
    if not 1 <= args.repeat <= 100:
        ap.error(f"need 1 <= --repeat <= 100, got {args.repeat}")
    variants = [parse_variant(v, ap) for v in args.variants]
    _, _, steps, warmup = peers.MODELS[args.model]
    runs = {v: [] for v in variants}
    for r in range(args.repeat):
        for impl, op in variants:
            try:
                out = spawn(run_rank, peers.WORLD, op, impl, args.model, steps, warmup)[0]
            except RankError as e:
                print(f"error: {impl} failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
                return 1
            step = statistics.median(out["times"][warmup:])
            runs[(impl, op)].append((step, out["wait_s"], out["cpu_s"]))
            print(f"# run {r + 1}/{args.repeat} {label(impl, op)}: step {step:.3f} s", file=sys.stderr, flush=True)
    print(f"model {args.model}, {peers.WORLD} gloo ranks, {steps} steps (median over steps {warmup + 1}-{steps}), "
          f"{args.repeat} interleaved runs")
    print(f"{'variant':<28} {'step s':>7} {'wait s':>7} {'cpu s':>7}  runs")
    for (impl, op), rows in runs.items():
        step, wait, cpu = (statistics.median(row[i] for row in rows) for i in range(3))
        print(f"{label(impl, op):<28} {step:>7.3f} {wait:>7.3f} {cpu:>7.3f}  "
              + " ".join(f"{row[0]:.3f}" for row in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
