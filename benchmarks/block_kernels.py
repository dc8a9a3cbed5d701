"""One GPT block's forward and backward on this CPU, eager against torch.compile (inductor), one thread: the
time a step spends in its blocks' compute, without collectives, and which kernels differ.

    python benchmarks/block_kernels.py [--model 30m|120m] [--repeat 15] [--top 12]

Prints the median of `--repeat` forward-and-backward calls of each, in turn, then the costliest ops of five
calls of each by self time under torch.profiler, inductor's generated kernels named
(`cpp.enable_kernel_profile`). Issue 31's eleventh step (docs/BENCHMARKS.md) asked whether inductor's kernels
are why the step compiled whole gains nothing over eager on this CPU."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import peers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(peers.MODELS), default="30m")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    import torch._inductor.config as inductor
    from torch.profiler import ProfilerActivity, profile

    from zerofunc.models import build_model, model_config
    inductor.cpp.enable_kernel_profile = True
    torch.set_num_threads(1)  # as a rank of benchmarks/peers.py runs
    base, overrides, _, _ = peers.MODELS[a.model]
    cfg = model_config(base, **overrides)
    block = build_model(cfg).h[0]
    x = torch.randn(peers.MICRO_BATCH, peers.SEQ, cfg.n_embd, requires_grad=True)
    runs = {"eager": block, "inductor": torch.compile(block)}

    def step(f) -> None:
        f(x).sum().backward()

    for f in runs.values():
        for _ in range(3):
            step(f)
    times = {name: [] for name in runs}
    for _ in range(a.repeat):
        for name, f in runs.items():
            t = time.perf_counter()
            step(f)
            times[name].append(time.perf_counter() - t)
    print(f"{a.model}: one block, {peers.MICRO_BATCH} x {peers.SEQ} tokens, forward and backward, one thread")
    for name, ts in times.items():
        print(f"{name:>9}  {1000 * statistics.median(ts):8.2f} ms")
    for name, f in runs.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step(f)
        print(f"\n{name}, five calls:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=64))


if __name__ == "__main__":
    main()
