"""What one training step costs the host, counted, not timed: the Python calls (cProfile) and the aten ops
(a dispatch mode) of one step, and its median time. Counts do not move with the machine's load, so an older
commit's engine and this one are compared on a busy 2-core box; on a GPU, a step too small to hide the host's
work runs at the host's pace (docs/CUDA.md), which is what this counts.

    PYTHONPATH=. python benchmarks/step_overhead.py [--compile]            # this tree
    cd OLD && PYTHONPATH=. python /path/to/benchmarks/step_overhead.py     # another commit's engine

One gloo rank, a 12-block GPT of width 64 (the blocks' count is what a step's host work grows with),
one micro-batch of 32 tokens, fp32, after 3 steps. Under the counting mode torch.compile runs eagerly,
so the aten ops are the eager step's either way; the Python calls and the time are the step's own.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def one_rank(stage: int, compile: bool) -> tuple[int, int, float]:
    from zerofunc.comm import DistCommunicator
    from zerofunc.engine import ZeroEngine
    from zerofunc.models import GPT, GPTConfig
    from zerofunc.optim import AdamWConfig
    from zerofunc.stages import STAGES
    from zerofunc.step import train_step

    cfg = GPTConfig(n_layer=12, n_head=2, n_embd=64, vocab_size=512, block_size=64)
    with torch.device("meta"):
        model = GPT(cfg)
    engine = ZeroEngine(model, STAGES[stage], DistCommunicator(), AdamWConfig(lr=1e-3),
                        init=lambda n, s: model.init_param(n, s, 0), compile=compile)
    g = torch.Generator().manual_seed(0)
    batch = [[torch.randint(0, cfg.vocab_size, (1, 32), generator=g) for _ in range(2)]]
    for _ in range(3):
        train_step(engine, batch)
    counting = _CountOps()
    with counting:
        train_step(engine, batch)
    profile = cProfile.Profile()
    profile.enable()
    train_step(engine, batch)
    profile.disable()
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        train_step(engine, batch)
        times.append(time.perf_counter() - t0)
    return counting.ops, pstats.Stats(profile).total_calls, sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compile", action="store_true", help="the blocks compiled (the default job's on a GPU)")
    p.add_argument("--stages", default="0,3")
    a = p.parse_args()
    from tests.bare import in_world
    print(f"{'stage':>5} {'compile':>7} {'aten ops':>9} {'Python calls':>12} {'median ms':>9}")
    for stage in (int(s) for s in a.stages.split(",")):
        ops, calls, ms = in_world(1, one_rank, stage, a.compile)[0]
        print(f"{stage:>5} {str(a.compile):>7} {ops:>9,} {calls:>12,} {ms:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
