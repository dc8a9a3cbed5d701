"""What zerofunc/comm_schedule.py's pass costs at compile time on a deep model: the stage-3 step compiled
whole (`aot_eager`: traced and partitioned as under inductor, without its C++), one first step on 2 gloo
ranks, the pass timed on each graph it moves (the forward and the backward), against the first step's time.

    python benchmarks/schedule_cost.py 10 20 40 80

Each argument is a layer count of a narrow GPT (width 16, 2 heads): the graphs grow with the layers as a
real model's do, the compute does not. The pass rebuilds its map of node positions after every move, so
its time grows with the square of the graph; this says how much that is."""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def first_step(n_layer: int) -> tuple[float, list[tuple[int, float]]]:
    """One rank: the first step's seconds, and (nodes, seconds) of each graph the pass moved."""
    import torch

    import zerofunc.whole_step as whole_step
    from zerofunc.comm import DistCommunicator
    from zerofunc.engine import ZeroEngine
    from zerofunc.models import GPT, GPTConfig
    from zerofunc.optim import AdamWConfig
    from zerofunc.stages import STAGES
    from zerofunc.step import train_step

    torch.set_num_threads(1)
    moved: list[tuple[int, float]] = []
    overlap = whole_step.overlap

    def timed(graph, *args, **kwargs):
        t0 = time.perf_counter()
        overlap(graph, *args, **kwargs)
        moved.append((len(graph.nodes), time.perf_counter() - t0))

    whole_step.overlap = timed  # read when WholeStep is built, below
    whole_step.WholeStep.backend = "aot_eager"
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=40, block_size=16)
    with torch.device("meta"):
        model = GPT(cfg)
    engine = ZeroEngine(model, STAGES[3], DistCommunicator(link=None), AdamWConfig(lr=1e-3),
                        init=lambda n, s: model.init_param(n, s, 0), compile="whole")
    x = torch.randint(0, cfg.vocab_size, (2, 11))
    t0 = time.perf_counter()
    train_step(engine, [[x, x]])
    return time.perf_counter() - t0, moved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layers", nargs="+", type=int, help="layer counts to measure")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.layers):
        ap.error("a layer count must be at least 1")
    from zerofunc.launch import spawn
    print("layers  first step s  pass per graph: nodes, s (rank 0)")
    for n in args.layers:
        total, moved = spawn(first_step, 2, n, timeout=1800)[0]
        print(f"{n:6d}  {total:12.1f}  " + ", ".join(f"{nodes} nodes {s:.2f} s" for nodes, s in moved), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
