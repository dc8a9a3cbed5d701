"""The engine's own CPU cost per step, where the model's compute is too small to hide it.

A GPU step of a small model is launch-bound: the GPU waits for Python to issue the next
kernel, so every microsecond the engine spends per torch call shows in the step time
(docs/CUDA.md: the tape's first version halved the default job's tokens/s on an H100).
This machine has no GPU, so the proxy is a CPU step of a 12-block GPT of width 64 on 16
tokens, one thread: its kernels take microseconds, and what is left is the engine's and
PyTorch's Python, the part a launch-bound GPU step waits on. One process, one rank.

Usage: python benchmarks/step_overhead.py [--stages 0,3] [--steps 60]
Two trees side by side (the old one first, interleaved by hand):
       PYTHONPATH=/old/checkout python /old/checkout/benchmarks/step_overhead.py   # if it has the script,
       PYTHONPATH=/old/checkout python benchmarks/step_overhead.py                 # or this one on its code
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread, as the Python that launches GPU kernels

import torch  # noqa: E402

from zerofunc.api import initialize  # noqa: E402
from zerofunc.models import build_model  # noqa: E402
from zerofunc.models.gpt2 import GPTConfig  # noqa: E402
from zerofunc.step import loss_of  # noqa: E402


def measure(stage: int, steps: int, warmup: int = 10) -> tuple[float, float, float]:
    """Median (forward, backward, update) seconds of `steps` steps after `warmup`."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(n_layer=12, n_head=4, n_embd=64, vocab_size=256, block_size=64))
    engine = initialize(model, {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1,
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    x, y = torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 16))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = loss_of(engine(x, y))
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0, t2 - t1, t3 - t2))
    return tuple(statistics.median(t[k] for t in times) for k in range(3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="0,3", help="comma-separated ZeRO stages (default 0,3)")
    p.add_argument("--steps", type=int, default=60, help="measured steps per stage (default 60)")
    a = p.parse_args(argv)
    try:
        stages = [int(s) for s in a.stages.split(",")]
        if any(s not in range(4) for s in stages) or a.steps < 1:
            raise ValueError
    except ValueError:
        print("error: --stages takes stages 0-3 separated by commas, --steps a positive count", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of {a.steps} steps, ms")
    print(f"{'stage':>5}  {'forward':>8}  {'backward':>8}  {'update':>8}  {'step':>8}")
    for s in stages:
        f, b, u = measure(s, a.steps)
        print(f"{s:>5}  {f * 1e3:8.2f}  {b * 1e3:8.2f}  {u * 1e3:8.2f}  {(f + b + u) * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
