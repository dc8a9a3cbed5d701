"""How long planning takes: python -m zerofunc.plan for gpt2-xl at world size 1024, all four stages.

Usage: python benchmarks/plan_speed.py [--repeats 3]
Prints the wall time of the whole command (interpreter start and imports included),
the median over repeats, and the planner's own table once.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMAND = [sys.executable, "-m", "zerofunc.plan", "--model", "gpt2-xl", "--world-size", "1024"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    repeats = p.parse_args().repeats
    times, table = [], ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        table = subprocess.run(COMMAND, check=True, capture_output=True, text=True).stdout
        times.append(time.perf_counter() - t0)
    print(table)
    print(f"command: {' '.join(COMMAND[1:])}")
    print("wall time per run (s): " + ", ".join(f"{t:.2f}" for t in times) + f"   median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
