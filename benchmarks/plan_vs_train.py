"""Does the trainer do what the planner predicts? Comm volume, peak memory and step time, stage by stage.

For each stage it runs `python -m train` (fp32, CPU, gloo) for a few steps, reads
comm_volume_bytes, peak_bytes and time_s from its metrics.jsonl (rank 0), and runs the
planner on the same configuration with the cpu-gloo profile. The measured step time is
the median over the steps after the first (which warms up); the planned one is the
planner's step time (compute, plus the communication it cannot hide).

`--model` is a preset or config.json, as for the trainer, or one of the peer benchmark's
models (`30m`, `120m`: benchmarks/peers.py), given to both as a config.json.

Usage: python benchmarks/plan_vs_train.py --model gpt2-tiny|30m|120m [--nproc 2 --micro-batch 8 --seq 128 --steps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def benchmark_model(name: str, where: Path) -> str:
    """A peer-benchmark model as a config.json the trainer and the planner both read; other names as given."""
    from benchmarks.peers import MODELS
    from zerofunc.models import hf_config_dict, model_config
    if name not in MODELS:
        return name
    base, overrides, _, _ = MODELS[name]
    path = where / f"{name}.json"
    path.write_text(json.dumps(hf_config_dict(model_config(base, **overrides))))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    if a.steps < 2:
        p.error("--steps must be at least 2: the first step warms up and is not timed")
    print(f"{a.model}, {a.nproc} gloo ranks, fp32, micro-batch {a.micro_batch} x {a.seq} tokens, {a.steps} steps "
          f"(step time: median of steps 2-{a.steps})")
    print(f"{'stage':>5}  {'planned comm B':>15}  {'trained comm B':>15}  {'equal':>5}  "
          f"{'planned peak B':>15}  {'trained peak B':>15}  {'peak ratio':>10}  "
          f"{'planned s':>9}  {'trained s':>9}  {'time ratio':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        model = benchmark_model(a.model, Path(tmp))
        common = ["--model", model, "--micro-batch", str(a.micro_batch), "--seq", str(a.seq)]
        for stage in range(4):
            out = Path(tmp) / f"stage{stage}"
            subprocess.run([sys.executable, "-m", "train", *common, "--stage", str(stage), "--nproc", str(a.nproc),
                            "--steps", str(a.steps), "--out", str(out), "--device", "cpu"], check=True,
                           capture_output=True)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            plan = json.loads(subprocess.run(
                [sys.executable, "-m", "zerofunc.plan", *common, "--world-size", str(a.nproc), "--stage", str(stage),
                 "--precision", "fp32", "--hardware", "cpu-gloo", "--json"],
                check=True, capture_output=True, text=True).stdout)["stages"][0]
            comm, peak, planned_s = plan["comm"]["volume_bytes"], plan["memory_bytes"]["peak"], plan["step_time_s"]
            trained_comm = {r["comm_volume_bytes"] for r in rows}
            trained_peak = max(r["peak_bytes"] for r in rows)
            trained_s = statistics.median(r["time_s"] for r in rows if r["step"] > 1)
            print(f"{stage:>5}  {comm:>15,}  {'/'.join(f'{c:,}' for c in sorted(trained_comm)):>15}  "
                  f"{'yes' if trained_comm == {comm} else 'NO':>5}  {peak:>15,}  {trained_peak:>15,}  "
                  f"{peak / trained_peak:>10.4f}  {planned_s:>9.3f}  {trained_s:>9.3f}  {planned_s / trained_s:>10.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
