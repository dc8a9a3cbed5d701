"""The step's memory on a CPU, eager beside compiled whole: the most bytes allocated at once during one step,
above what was allocated when it began, from the profiler's allocation events (the CPU allocator's running
total). It counts every buffer inductor's generated code allocates; the memory tracker (zerofunc.check's CPU
measure) sees tensors through dispatch, so not a compiled graph's buffers.

    python benchmarks/step_memory_cpu.py --model gpt2-small --stages 0 3 --precision bf16 --micro-batch 8 --seq 128 --gpu-layout

One rank (a gloo group of one), the third step measured (the first compiles). `--gpu-layout`: stages 0-1 reduce
each gradient in backward, as the step compiled whole does on a GPU (`WholeStep.reduce_in_backward`), not after
it as on a CPU; the graphs are then the GPU's as traced, lowered by inductor's CPU backend. `--live N`: the N
largest allocations live at the peak, each with the phase that made it (forward, backward, reduce, update:
the step's calls benchmarks/step_phases.py times, marked), and the phase the peak falls in.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_phases import phase_calls  # noqa: E402
from zerofunc.launch import spawn  # noqa: E402

GiB = 2**30


def _phase(event) -> str:
    """The step's phase an allocation event happened in: the marker (`phases`) it lies under."""
    while event is not None:
        if event.name.startswith("phase: "):
            return event.name.removeprefix("phase: ")
        event = event.parent
    return "unmarked"  # outside the step's marked calls: another thread's (a collective's), or between calls


def allocated_peak(prof) -> tuple[int, str, list[tuple[int, str]]]:
    """The most bytes allocated at once while `prof` recorded, above what was allocated when it began; the
    phase it fell in; and the allocations live then, largest first, each with the phase that made it."""
    from torch._C._profiler import _EventType
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            events.append((e.start_time_ns, f.alloc_size, f.total_allocated, f.ptr, _phase(e)))
        stack.extend(e.children)
    events.sort()
    start = events[0][2] - events[0][1]  # the running total before the first event
    at = max(range(len(events)), key=lambda i: events[i][2])
    live: dict[int, tuple[int, str]] = {}
    for _, size, _, ptr, phase in events[:at + 1]:
        if size > 0:
            live[ptr] = (size, phase)
        else:
            live.pop(ptr, None)  # freed (one made before the profiler began is not listed)
    return events[at][2] - start, events[at][4], sorted(live.values(), reverse=True)


@contextlib.contextmanager
def phases(engine):
    """The step's calls under profiler markers named by phase (benchmarks/step_phases.py's `phase_calls`)."""
    calls = phase_calls(engine)
    originals = [getattr(owner, name) for owner, name, _ in calls]
    for (owner, name, phase), fn in zip(calls, originals):
        setattr(owner, name, _marked(fn, phase))
    try:
        yield
    finally:
        for (owner, name, _), fn in zip(calls, originals):
            if isinstance(owner, type):
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # back to the class's method


def _marked(fn, phase: str):
    @functools.wraps(fn)
    def marked(*args, **kwargs):
        with torch.profiler.record_function(f"phase: {phase}"):
            return fn(*args, **kwargs)
    return marked


def measure(model_name: str, stage: int, compile, precision: str, micro_batch: int, seq: int,
            gpu_layout: bool):
    from zerofunc.comm import DistCommunicator
    from zerofunc.engine import ZeroEngine
    from zerofunc.models import build_model, model_config
    from zerofunc.optim import AdamWConfig
    from zerofunc.stages import STAGES
    from zerofunc.step import train_step
    from zerofunc.whole_step import WholeStep
    WholeStep.reduce_in_backward = True if gpu_layout else None
    torch.set_num_threads(2)
    cfg = model_config(model_name)
    with torch.device("meta"):
        model = build_model(cfg)
    engine = ZeroEngine(model, STAGES[stage], DistCommunicator(link=None), AdamWConfig(),
                        init=lambda n, s: model.init_param(n, s, 0), compile=compile, precision=precision)
    g = torch.Generator().manual_seed(0)
    batch = lambda: [[torch.randint(0, cfg.vocab_size, (micro_batch, seq), generator=g) for _ in range(2)]]  # noqa: E731
    for _ in range(2):
        train_step(engine, batch())
    with phases(engine), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                profile_memory=True) as prof:
        loss = train_step(engine, batch())
    return allocated_peak(prof), loss.item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-small", help="a preset or a config.json, as python -m train takes")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 3], choices=range(4))
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--gpu-layout", action="store_true")
    p.add_argument("--live", type=int, default=0, metavar="N", help="list the N largest allocations live at the peak")
    a = p.parse_args()
    from zerofunc.models import model_config
    try:
        model_config(a.model)
    except ValueError as e:
        print(f"error: --model: {e}", file=sys.stderr)
        return 2
    print(f"{a.model}, {a.micro_batch} x {a.seq} tokens, {a.precision}, one rank, "
          f"{'the GPU' if a.gpu_layout else 'the CPU'}'s layout; GiB allocated at once above the step's start")
    print("stage  eager  whole  whole/eager  loss eager  loss whole  peak in (eager, whole)")
    listings = []
    for stage in a.stages:
        (eager, loss_e), = spawn(measure, 1, a.model, stage, False, a.precision, a.micro_batch, a.seq, a.gpu_layout)
        (whole, loss_w), = spawn(measure, 1, a.model, stage, "whole", a.precision, a.micro_batch, a.seq, a.gpu_layout)
        print(f"{stage:5d}  {eager[0] / GiB:5.3f}  {whole[0] / GiB:5.3f}  {whole[0] / eager[0]:11.3f}  {loss_e:10.4f}  "
              f"{loss_w:10.4f}  {eager[1]}, {whole[1]}")
        listings += [(stage, "eager", eager), (stage, "whole", whole)]
    for stage, mode, (peak, phase, live) in listings if a.live else ():
        print(f"\nstage {stage}, {mode}: peak {peak / 2**20:.1f} MiB in {phase}; the largest live, MiB (made in):")
        print("  " + ", ".join(f"{size / 2**20:.1f} ({made})" for size, made in live[:a.live]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
