"""Does the trainer do what the planner predicts? Comm volume and peak memory, stage by stage.

For each stage it runs `python -m train` (fp32, CPU, gloo) for a few steps, reads
comm_volume_bytes and peak_bytes from its metrics.jsonl (rank 0), and runs the planner
on the same configuration with the cpu-gloo profile.

Usage: python benchmarks/plan_vs_train.py --model gpt2-tiny [--nproc 2 --micro-batch 8 --seq 128 --steps 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    common = ["--model", a.model, "--micro-batch", str(a.micro_batch), "--seq", str(a.seq)]
    print(f"{a.model}, {a.nproc} gloo ranks, fp32, micro-batch {a.micro_batch} x {a.seq} tokens, {a.steps} steps")
    print(f"{'stage':>5}  {'planned comm B':>15}  {'trained comm B':>15}  {'equal':>5}  "
          f"{'planned peak B':>15}  {'trained peak B':>15}  {'peak ratio':>10}")
    for stage in range(4):
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, "-m", "train", *common, "--stage", str(stage), "--nproc", str(a.nproc),
                            "--steps", str(a.steps), "--out", out, "--device", "cpu"], check=True,
                           capture_output=True)
            rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        plan = json.loads(subprocess.run(
            [sys.executable, "-m", "zerofunc.plan", *common, "--world-size", str(a.nproc), "--stage", str(stage),
             "--precision", "fp32", "--hardware", "cpu-gloo", "--json"],
            check=True, capture_output=True, text=True).stdout)["stages"][0]
        comm, peak = plan["comm"]["volume_bytes"], plan["memory_bytes"]["peak"]
        trained_comm = {r["comm_volume_bytes"] for r in rows}
        trained_peak = max(r["peak_bytes"] for r in rows)
        print(f"{stage:>5}  {comm:>15,}  {'/'.join(f'{c:,}' for c in sorted(trained_comm)):>15}  "
              f"{'yes' if trained_comm == {comm} else 'NO':>5}  {peak:>15,}  {trained_peak:>15,}  "
              f"{peak / trained_peak:>10.4f}")


if __name__ == "__main__":
    main()
