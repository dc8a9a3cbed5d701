"""What each memory lever costs and saves on this machine, measured beside the planner's prediction.

1. The host's AdamW: zerofunc's offloaded update (torch's fused CPU AdamW over the flat
   shard) against `torch.optim.AdamW(fused=True)` on CPU, and the eager reference, on one
   flat fp32 shard. GB/s counts the bytes an update must move: 28 per element (param, m, v
   read and written, the fp32 gradient read), as benchmarks/fused_adamw.py counts them.
2. A training step of gpt2-small (fp32, micro-batch 4 x 256, one gloo rank, stage 1) with
   each lever on, against none: median step time (ratio to none), the activation peak and
   the device and host peaks the memory tracker measured on the real tensors, and the
   planner's activation peak for the same plan.
3. The output head alone (gpt2-small's, at the same tokens): `F.cross_entropy(F.linear(h, w))`
   against zerofunc's chunked `LinearCrossEntropy`, keeping its gradient and recomputing it.

    python benchmarks/levers.py [--numel 16777216] [--model gpt2-small] [--micro-batch 4] [--seq 256] [--steps 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sim.memory import MemoryTracker
from zerofunc.check.calibrate import wall_median_s
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.fused import adamw_reference_
from zerofunc.lm_head import LinearCrossEntropy
from zerofunc.models import build_model, model_config
from zerofunc.offload import OptimizerOffload
from zerofunc.optim import AdamWConfig
from zerofunc.plan import Plan, simulate
from zerofunc.recompute import ActivationCheckpointing
from zerofunc.stages import STAGES
from zerofunc.step import train_step

MiB = 2**20


def adamw_rates(n: int, iters: int) -> None:
    cfg = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen)
    step = [0]

    def ours():
        master, m, v, staging = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), grad.clone()
        offload = OptimizerOffload(torch.device("cpu"), MemoryTracker())

        def run():
            step[0] += 1
            offload.update(master, staging, m, v, step[0], cfg, None, 1.0, None)
        return run

    def theirs():
        p = torch.nn.Parameter(torch.randn(n, generator=gen))
        p.grad = grad
        opt = torch.optim.AdamW([p], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
        return opt.step

    def reference():
        master, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)

        def run():
            step[0] += 1
            adamw_reference_(master, grad, m, v, step[0], cfg)
        return run

    print(f"AdamW on one flat fp32 shard of {n:,} elements, CPU, {torch.get_num_threads()} threads, median of {iters}")
    print(f"{'variant':<48} {'ms':>8} {'GB/s':>7} {'Mparam/s':>9} {'vs torch fused':>15}")
    rows = [(name, wall_median_s(make(), 2, iters)) for name, make in (
        ("zerofunc offloaded update (_fused_adamw_)", ours), ("torch.optim.AdamW(fused=True)", theirs),
        ("zerofunc adamw_reference_ (eager, 7 passes)", reference))]
    torch_s = rows[1][1]
    for name, s in rows:
        print(f"{name:<48} {s * 1e3:>8.2f} {28 * n / s / 1e9:>7.2f} {n / s / 1e6:>9.0f} {torch_s / s:>14.2f}x")


def lever_costs(model_name: str, micro_batch: int, seq: int, steps: int) -> None:
    cfg = model_config(model_name)
    levers = [("none", "none", False), ("AC full", "full", False), ("AC every 2", "selective", False),
              ("offload", "none", True), ("AC full + offload", "full", True)]
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (micro_batch, seq), generator=gen) for _ in range(2))
    print(f"\n{model_name}, fp32, micro-batch {micro_batch} x {seq}, 1 gloo rank, ZeRO stage 1, median of {steps} steps")
    print(f"{'levers':<20} {'step s':>7} {'vs none':>8} {'activ MiB':>10} {'planned':>8} {'device MiB':>11} "
          f"{'planned':>8} {'host MiB':>9}")
    base = None
    for name, ac, offload in levers:
        with torch.device("meta"):
            model = build_model(cfg)
        tracker = MemoryTracker()
        engine = ZeroEngine(model, STAGES[1], DistCommunicator(), AdamWConfig(), memory=tracker,
                            init=lambda n, s, model=model: model.init_param(n, s, 0),
                            checkpointing=ActivationCheckpointing(ac), offload_optimizer=offload)

        def step(engine=engine):  # bound now: the loop deletes the name at its end
            train_step(engine, [(x, y)])
        step()  # warm-up, untracked
        times, act, peak, host = [], 0, 0, 0
        for _ in range(steps):
            tracker.reset_peak()
            t = time.perf_counter()
            with tracker:
                step()
            times.append(time.perf_counter() - t)
            r = tracker.report()
            act, peak, host = max(act, r.max_by_category["activations"]), max(peak, r.peak), max(host, r.host_peak)
        sim = simulate(Plan(world_size=1, stage=1, model=model_name, precision="fp32", micro_batch=micro_batch, seq=seq,
                            hardware="cpu-gloo", activation_checkpointing=ac, offload_optimizer=offload), timing=False)
        s = statistics.median(times)
        base = base or s
        print(f"{name:<20} {s:>7.2f} {s / base:>7.2f}x {act / MiB:>10.1f} {sim.memory.max_by_category['activations'] / MiB:>8.1f} "
              f"{peak / MiB:>11.1f} {sim.memory.peak / MiB:>8.1f} {host / MiB:>9.1f}")
        del engine, model


def head_costs(model_name: str, micro_batch: int, seq: int, iters: int) -> None:
    cfg = model_config(model_name)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(micro_batch * seq, cfg.n_embd, generator=gen).requires_grad_()
    w = (torch.randn(cfg.vocab_size, cfg.n_embd, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, cfg.vocab_size, (micro_batch * seq,), generator=gen)
    heads = {}
    for recompute in (False, True):
        heads[recompute] = LinearCrossEntropy()
        heads[recompute].recompute = recompute
    rows = [("F.cross_entropy(F.linear(h, w).float(), t)",
             wall_median_s(lambda: F.cross_entropy(F.linear(h, w).float(), t).backward(), 2, iters)),
            ("LinearCrossEntropy, keeping its gradient", wall_median_s(lambda: heads[False](h, w, t).backward(), 2, iters)),
            ("LinearCrossEntropy, recomputing", wall_median_s(lambda: heads[True](h, w, t).backward(), 2, iters))]
    print(f"\n{model_name}'s output head alone, fp32, {micro_batch * seq} tokens, forward + backward, median of {iters}")
    print(f"{'head':<48} {'ms':>8} {'vs torch':>9}")
    for name, s in rows:
        print(f"{name:<48} {s * 1e3:>8.1f} {s / rows[0][1]:>8.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=2**24)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    adamw_rates(a.numel, a.iters)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    lever_costs(a.model, a.micro_batch, a.seq, a.steps)
    head_costs(a.model, a.micro_batch, a.seq, 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
