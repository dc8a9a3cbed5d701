"""What one training step costs the host, counted, not timed: the Python calls (cProfile) and the aten ops
(a dispatch mode) of one step, and its median time. Counts do not move with the machine's load, so an older
commit's engine and this one are compared on a busy 2-core box; on a GPU, a step too small to hide the host's
work runs at the host's pace (docs/CUDA.md), which is what this counts.

    PYTHONPATH=. python benchmarks/step_overhead.py [--compile]            # this tree
    cd OLD && PYTHONPATH=. python /path/to/benchmarks/step_overhead.py     # another commit's engine
    ... --device cuda --precision bf16 --width 768 --tokens 8x128 --top 25  # the default job's step on a GPU,
                                                                           # and where its host time goes
    ... --thread-ab                                                        # the tape's autograd on the calling
                                                                           # thread against the device's, in turn
    ... --kernels 25                                                       # one step under torch.profiler: the
                                                                           # device's busy time, the top ops

One gloo rank, a 12-block GPT of width 64 (the blocks' count is what a step's host work grows with),
one micro-batch of 32 tokens, fp32, after 3 steps (the flags change each). On CUDA the step is timed to a
synchronize, and cProfile's wall time of a C call (autograd's `run_backward`) includes the GPU work it waits for. Under the counting mode torch.compile runs eagerly,
so the aten ops are the eager step's either way; the Python calls and the time are the step's own.
"""
from __future__ import annotations

import argparse
import cProfile
import io
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


def one_rank(stage: int, compile: bool, device: str, precision: str, width: int, tokens: tuple[int, int],
             top: int, thread_ab: bool = False, kernels: int = 0) -> tuple[int, int, float, str, str]:
    from zerofunc.comm import DistCommunicator
    from zerofunc.engine import ZeroEngine
    from zerofunc.models import GPT, GPTConfig
    from zerofunc.optim import AdamWConfig
    from zerofunc.stages import STAGES
    from zerofunc.step import train_step

    if device == "cuda":
        torch.cuda.set_device(0)
    cfg = GPTConfig(n_layer=12, n_head=max(1, width // 64), n_embd=width, vocab_size=512 if width <= 64 else 50304,
                    block_size=max(64, tokens[1]))
    with torch.device("meta"):
        model = GPT(cfg)
    engine = ZeroEngine(model, STAGES[stage], DistCommunicator(), AdamWConfig(lr=1e-3), device=device,
                        init=lambda n, s: model.init_param(n, s, 0), compile=compile, precision=precision)
    g = torch.Generator().manual_seed(0)
    batch = [[torch.randint(0, cfg.vocab_size, tokens, generator=g).to(device) for _ in range(2)]]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        train_step(engine, batch)
    counting = _CountOps()
    with counting:
        train_step(engine, batch)
    sync()
    profile = cProfile.Profile()
    profile.enable()
    train_step(engine, batch)
    sync()
    profile.disable()
    times = _step_times(lambda: train_step(engine, batch), sync, 15)
    threads = _thread_ab(lambda: train_step(engine, batch), sync) if thread_ab else ""
    stats = pstats.Stats(profile, stream=io.StringIO())
    if top:
        stats.sort_stats("tottime").print_stats(top)
    listing = stats.stream.getvalue() if top else ""
    if kernels:
        listing += _device_profile(lambda: train_step(engine, batch), sync, device, kernels)
    return (counting.ops, stats.total_calls, _median_ms(times), threads, listing)


def _device_profile(step, sync, device: str, n: int) -> str:
    """One step under torch.profiler: how long the device was busy against the step's wall time (a
    launch-bound step leaves it idle), the `n` ops and kernels that took the most device time, and the `n`
    that took the most host time (a synchronize the host waits in shows there: `cudaStreamSynchronize`,
    `aten::_local_scalar_dense`)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    out = [f"\none step profiled: {wall * 1e3:.1f} ms of wall time (profiler's own cost included)"]
    if device == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e3
        out.append(f"device busy {busy:.1f} ms (the sum of every kernel's and copy's own time)")
        out.append(events.table(sort_by="self_device_time_total", row_limit=n))
    out.append(events.table(sort_by="self_cpu_time_total", row_limit=n))
    return "\n".join(out)


def _step_times(step, sync, n: int) -> list[float]:
    """Seconds of each of `n` steps, each timed from a synchronize to one after it."""
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _median_ms(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] * 1e3


def _thread_ab(step, sync, rounds: int = 4, steps: int = 10) -> str:
    """The step's median time with the tape differentiating on the calling thread and on autograd's device
    worker thread (torch's default for CUDA graphs), in turn in one process: what the tape's choice saves.
    A tree without the choice (an older engine) says so."""
    from zerofunc import engine as engine_module  # the tape the engine differentiates with, if it has one
    tape = getattr(engine_module, "Tape", None)
    if not hasattr(tape, "worker_thread"):
        return "no choice of thread in this tree"
    times = {False: [], True: []}
    try:
        for _ in range(rounds):
            for worker in (False, True):
                tape.worker_thread = worker
                times[worker] += _step_times(step, sync, steps)
    finally:
        tape.worker_thread = False
    calling, worker = _median_ms(times[False]), _median_ms(times[True])
    return f"calling thread {calling:.1f} ms, worker thread {worker:.1f} ms (medians of {rounds} x {steps} steps each, in turn)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compile", action="store_true", help="the blocks compiled (the default job's on a GPU)")
    p.add_argument("--stages", default="0,3")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one NCCL rank on GPU 0")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--width", type=int, default=64, help="n_embd of the 12 blocks (768: gpt2-small's, with its vocabulary)")
    p.add_argument("--tokens", default="1x32", help="micro-batch, sequences x tokens (the default job's: 8x128)")
    p.add_argument("--thread-ab", action="store_true",
                   help="also time the step with the tape differentiating on the calling thread (this tree's) and "
                        "on autograd's device thread (torch's default), in turn")
    p.add_argument("--top", type=int, default=0, help="also print the step's N costliest functions by own time (cProfile)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also profile one step (torch.profiler): the device's busy time against the step's, and "
                        "the N ops taking the most device time and the most host time")
    a = p.parse_args()
    from tests.bare import in_world
    tokens = tuple(int(n) for n in a.tokens.split("x"))
    print(f"{'stage':>5} {'compile':>7} {'aten ops':>9} {'Python calls':>12} {'median ms':>9}")
    for stage in (int(s) for s in a.stages.split(",")):
        ops, calls, ms, threads, profile = in_world(1, one_rank, stage, a.compile, a.device, a.precision, a.width,
                                                    tokens, a.top, a.thread_ab, a.kernels,
                                                    backend="nccl" if a.device == "cuda" else "gloo")[0]
        print(f"{stage:>5} {str(a.compile):>7} {ops:>9,} {calls:>12,} {ms:>9.1f}{'  ' + threads if threads else ''}",
              flush=True)
        if profile:
            print(profile, flush=True)


if __name__ == "__main__":
    main()
