"""How long planning takes: the whole python -m zerofunc.plan command, interpreter start and imports included.

Usage: python benchmarks/plan_speed.py [--repeats 3] [--quick]
Plans every stage at world size 1024, each with its largest micro-batch found, for
gpt2-xl, llama3-70b and llama3.1-405b (seq 4096, where nothing fits and one simulation
per stage answers, and seq 1024, where stage 3 fits and its largest micro-batch takes
a second), and `--world-size auto` for llama3-70b, alone and with `--shard-group auto` at its own
context (issue 25's bound: under 30 s on this 2-core machine; issue 33's: that under 30 s, and a fixed-size
70B plan, the 70B commands at 1024, under 10 s). Prints the median wall time of each command and the planner's
table once. `--quick` runs each command once.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

PLAN = [sys.executable, "-m", "zerofunc.plan"]
COMMANDS = [
    ["--model", "gpt2-xl", "--world-size", "1024"],
    ["--model", "llama3-70b", "--world-size", "1024", "--seq", "4096"],
    ["--model", "llama3-70b", "--world-size", "1024", "--seq", "1024"],
    ["--model", "llama3.1-405b", "--world-size", "1024", "--seq", "4096"],
    ["--model", "llama3.1-405b", "--world-size", "1024", "--seq", "1024"],
    ["--model", "llama3-70b", "--world-size", "auto", "--hardware", "h100-sxm", "--seq", "4096"],
    ["--model", "llama3-70b", "--world-size", "auto", "--shard-group", "auto", "--hardware", "h100-sxm"],
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run per command")
    a = p.parse_args()
    repeats = 1 if a.quick else a.repeats
    rows = []
    for args in COMMANDS:
        times, table = [], ""
        for _ in range(repeats):
            t0 = time.perf_counter()
            table = subprocess.run(PLAN + args, check=True, capture_output=True, text=True).stdout
            times.append(time.perf_counter() - t0)
        print(table)
        rows.append((" ".join(args), times))
    width = max(len(r[0]) for r in rows)
    print(f"{'python -m zerofunc.plan ...'.ljust(width)}  median s  runs (s)")
    for args, times in rows:
        print(f"{args.ljust(width)}  {statistics.median(times):8.2f}  {', '.join(f'{t:.2f}' for t in times)}")


if __name__ == "__main__":
    main()
