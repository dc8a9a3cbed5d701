"""What the trainer's CPU memory tracker costs a step, which the planner does not charge.

On CPU, `python -m train` measures each step's peak with `sim.memory.MemoryTracker`, a
dispatch mode that sees every op. This runs one rank's steps (1 gloo rank, one thread,
the trainer's model, built as it builds it, and data) alternately with and without the tracker entered, and
prints the medians, the ops a step dispatches, and the tracker's cost per op.

Usage: python benchmarks/tracker_cost.py [--model gpt2-tiny] [--micro-batch 8] [--seq 128] [--steps 6]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model_name: str, stage: int, micro_batch: int, seq: int, steps: int) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import zerofunc
    from sim.memory import MemoryTracker
    from train.data import load_tokens, rank_batch
    from zerofunc.comm import DistCommunicator
    from zerofunc.models import build_model, model_config

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tracker = MemoryTracker()
    engine = zerofunc.initialize(build_model(model_config(model_name, dropout=0.0)),
                                 {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": stage}},
                                 comm=DistCommunicator(), memory=tracker)
    tokens = load_tokens(None, seq)

    def step(i: int, mode) -> float:
        x, y, _ = rank_batch(tokens, i, micro_batch, 1, 0, seq, 0)
        t = time.perf_counter()
        with mode:
            engine.backward(engine(x, y))
            engine.step()
        return time.perf_counter() - t

    for i in range(2):  # warm-up, tracked (the tracker's first step allocates its own records)
        step(i, tracker)
    counting = CountOps()
    step(2, counting)
    times = {"without": [], "with": []}
    for i in range(steps):
        times["without"].append(step(3 + i, contextlib.nullcontext()))
        times["with"].append(step(3 + i, tracker))
    return {"ops": counting.ops} | {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    from zerofunc.launch import spawn
    from zerofunc.models import model_config
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="steps timed each way, alternating (default 6)")
    a = ap.parse_args(argv)
    try:
        config = model_config(a.model)
    except ValueError as e:
        ap.error(str(e))
    if a.micro_batch < 1 or a.steps < 1 or not 1 <= a.seq <= config.block_size:
        ap.error(f"need --micro-batch and --steps >= 1 and 1 <= --seq <= {config.block_size}")
    print(f"{a.model}, 1 gloo rank, 1 thread, micro-batch {a.micro_batch} x {a.seq} tokens, "
          f"median of {a.steps} steps each way")
    print(f"{'stage':>5} {'ops/step':>9} {'without ms':>11} {'with ms':>9} {'cost':>7} {'us/op':>6}")
    for stage in (0, 3):
        r = spawn(measure, 1, a.model, stage, a.micro_batch, a.seq, a.steps)[0]
        extra = r["with"] - r["without"]
        print(f"{stage:>5} {r['ops']:>9} {r['without'] * 1e3:>11.1f} {r['with'] * 1e3:>9.1f} "
              f"{extra / r['without']:>7.1%} {extra / r['ops'] * 1e6:>6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
