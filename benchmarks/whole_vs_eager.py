"""The step compiled whole against the eager step, their steps interleaved in one world, so that both run in
the same seconds of the host.

    python benchmarks/whole_vs_eager.py [--model 30m] [--stages 0 1 2 3] [--pairs 20] [--control] [--json]

benchmarks/peers.py runs each implementation in its own world, one after another: on this 2-core host the
same row moves by up to 10% from one run to the next, minutes apart (docs/BENCHMARKS.md), more than what
tells compiled whole from eager at 30m. Here each stage gets one world of 2 gloo ranks (one thread each, as
in peers.py) holding two engines of the same model, weights and batches: `--compile whole` and eager. After
`--warmup` steps of each (the first compiles), each of `--pairs` rounds takes one step of each, the order
alternating from round to round, each step behind a barrier and timed on rank 0 to its end. A round's
ratio is its whole step's time over its eager step's; the table gives the medians, the geometric mean of
the rounds' ratios with a 95% interval (Student's t over the logs), and the two engines' losses after
the last round, averaged over the ranks: they see the same batches, and agree within the 1e-4 (relative)
the peers are held to (fp32 reordered by the compiled kernels). `--control` makes the second engine eager
as well: what the method reads between two equal steps. It read up to 5% (30m) and 7% (120m) from 1, beyond
one run's interval (docs/BENCHMARKS.md, issue 31's fifteenth step): each world has an offset of its own, so
compare runs of several worlds, and the control's spread."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import peers  # noqa: E402  (benchmarks/ is on the path when run as a script)
from benchmarks.peer_steps import training  # noqa: E402

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 14: 2.14,
       19: 2.09, 29: 2.05}  # Student's t, two-sided 95%, by degrees of freedom (the next lower one is used)


def t95(df: int) -> float:
    return T95[max(k for k in T95 if k <= df)] if df >= 1 else math.nan


def run_rank(model_name: str, stage: int, warmup: int, pairs: int, control: bool = False) -> dict:
    """One rank: both engines, `warmup` steps each, then `pairs` rounds of one step each; rank 0's times.
    `control`: the second engine eager too (see --control)."""
    import torch
    import torch.distributed as dist
    from train.data import load_tokens, rank_batch

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = load_tokens(None, peers.SEQ)
    dev = torch.device("cpu")
    steps = {mode: training(family, stage, peers.build_model(model_name), dev, peers.MICRO_BATCH, peers.OPT)[1]
             for mode, family in (("eager", "zerofunc"), ("whole", "zerofunc" if control else "zerofunc-whole"))}
    times: dict[str, list[float]] = {"eager": [], "whole": []}
    losses: dict[str, float] = {}
    for i in range(warmup + pairs):
        x, y = rank_batch(tokens, i + 1, peers.MICRO_BATCH, world, rank, peers.SEQ, peers.SEED)[:2]
        for mode in (("eager", "whole") if i % 2 == 0 else ("whole", "eager")):
            dist.barrier()
            t0 = time.perf_counter()
            loss = steps[mode](x, y)
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times[mode].append(elapsed)
            losses[mode] = float(loss.detach())
    # averaged over the ranks, as peers.py reports it: the eager step returns this rank's loss, the step
    # compiled whole the global batch's (zerofunc.step)
    final = torch.tensor([losses["eager"], losses["whole"]], dtype=torch.float64)
    dist.all_reduce(final)
    return {"times": times, "losses": dict(zip(("eager", "whole"), (final / world).tolist()))}


def summarize(stage: int, out: dict) -> dict:
    eager, whole = out["times"]["eager"], out["times"]["whole"]
    logs = [math.log(w / e) for e, w in zip(eager, whole)]
    mean = statistics.mean(logs)
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.nan
    return {"stage": stage, "eager_s": statistics.median(eager), "whole_s": statistics.median(whole),
            "ratio": math.exp(mean), "ratio_low": math.exp(mean - half), "ratio_high": math.exp(mean + half),
            "eager_times_s": eager, "whole_times_s": whole, "losses": out["losses"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="30m", choices=sorted(peers.MODELS))
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    ap.add_argument("--pairs", type=int, default=20, help="rounds of one step of each (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="steps of each before the rounds (the first compiles)")
    ap.add_argument("--json", action="store_true", help="also print the rows, with every step's time, as JSON")
    ap.add_argument("--control", action="store_true",
                    help="the second engine eager too: what the method reads between two equal steps (about 1)")
    args = ap.parse_args(argv)
    if args.pairs < 2 or args.warmup < 1:
        ap.error("need --pairs >= 2 and --warmup >= 1")
    from zerofunc.launch import RankError, spawn
    print(f"model {args.model}, {peers.WORLD} gloo ranks, seq {peers.SEQ}, micro-batch {peers.MICRO_BATCH}/rank, "
          f"fp32; {args.pairs} rounds of one step each, interleaved, after {args.warmup} of each; rank 0's seconds"
          + ("; control: the 'whole' engine is a second eager one" if args.control else ""))
    print(f"{'stage':>5}  {'eager s':>8}  {'whole s':>8}  {'whole / eager':>13}  {'95% interval':>13}  "
          f"{'loss eager':>10}  {'loss whole':>10}")
    rows = []
    for stage in args.stages:
        try:
            out = spawn(run_rank, peers.WORLD, args.model, stage, args.warmup, args.pairs, args.control)[0]
        except RankError as e:
            print(f"stage {stage}: {e}", file=sys.stderr)
            return 1
        row = summarize(stage, out)
        rows.append(row)
        print(f"{stage:>5}  {row['eager_s']:>8.3f}  {row['whole_s']:>8.3f}  {row['ratio']:>13.3f}  "
              f"{row['ratio_low']:>6.3f}-{row['ratio_high']:.3f}  {row['losses']['eager']:>10.6f}  "
              f"{row['losses']['whole']:>10.6f}", flush=True)
    print(f"1-minute load average after: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
