"""What the CUDA allocator holds at a check cell's peak, by where it was allocated.

    python benchmarks/cuda_memory_snapshot.py --model gpt2-small --stage 3 --world-size 64 [--compile blocks|whole]
        [--micro-batch 4 --seq 1024] [--pickle F]

Runs one cell of `python -m zerofunc.check` (the trainer's step, rank 0 of a simulated
world) in a fresh process under `torch.cuda.memory._record_memory_history`, then replays
the allocator's trace: at the moment of the measured step (the second: the first compiles)
when the most bytes were allocated, it lists the live blocks grouped by the innermost frame
in zerofunc/ or sim/ and by the innermost frame of all, beside the cell's planned and
measured peaks. What the planner does not count shows up as a group it has no line for (a
library's workspace, the allocator's rounding). Then it
runs the cell again with every op of its first measured step under a probe that lists the
ops holding memory only while they run (the allocator's peak during the op above what was
allocated before and after it), and the op during which the step peaked: what
sim/kernel_memory.py models, or should. `--pickle F` keeps the snapshot for
pytorch.org/memory_viz.

`--compile whole`: the step compiled whole, whose buffers inductor's generated code allocates: a
block's innermost frame is then a line of that code, printed with its text (the buffer's name, shape
and dtype). The planned peak is still the eager step's (the planner does not plan the compiled step's
memory), so the gap between the two is what compiling whole costs or saves; the op probe is skipped
(a dispatch mode sees a compiled graph's calls, not its kernels).
"""
from __future__ import annotations

import argparse
import linecache
import pickle
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zerofunc.check.cells as cells  # noqa: E402
from zerofunc.check.cells import run_cell  # noqa: E402
from sim.hardware import profile_for_device  # noqa: E402
from zerofunc.plan import Plan  # noqa: E402

MiB = 2**20


def live_at_peak(trace: list[dict], start: int = 0, end: int | None = None) -> tuple[int, list[dict]]:
    """The largest total of allocated blocks over the trace's entries `start` to `end` (what was allocated
    before them counted as live), and the blocks live then (two passes: find when, then replay to that
    moment)."""
    end = len(trace) if end is None else end

    def replay(stop: int | None):
        live, total, best, at = {}, 0, 0, -1
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > best and start <= i < end:
                    best, at = total, i
            elif e["action"] == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
        return best, at, live

    best, at, _ = replay(None)
    return best, list(replay(at + 1)[2].values())


def trace_length() -> int:
    return len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])


def measured_step_starts(marks: list[int]):
    """A stand-in for the cell's train_step that notes where in the allocator's trace each step begins: the
    first step compiles (its autotuning and warm-up allocate what no later step does), the second is measured,
    a third runs under the cell's memory tracker."""
    step = cells.train_step

    def marked(engine, batch):
        marks.append(trace_length())
        return step(engine, batch)
    return step, marked


class OpTransients(TorchDispatchMode):
    """Per op: the bytes it held only while it ran (a kernel's workspace, a temporary), as the
    allocator's peak during the op above what was allocated before and after it."""

    def __init__(self):
        super().__init__()
        self.ops = defaultdict(lambda: [0, 0])  # name -> [calls with a transient, largest transient]
        self.peak, self.peak_op, self.peak_transient = 0, None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        transient = peak - max(before, after)
        if transient > 0:
            o = self.ops[str(func)]
            o[0] += 1
            o[1] = max(o[1], transient)
        if peak > self.peak:
            self.peak, self.peak_op, self.peak_transient = peak, str(func), transient
        return out


def op_transients(plan: Plan, compile: bool | str) -> OpTransients:
    """Run the cell once more with every op of its second (first measured) step under OpTransients."""
    probe, calls, step = OpTransients(), [0], cells.train_step

    def probed(engine, batch):
        calls[0] += 1
        if calls[0] != 2:
            return step(engine, batch)
        with probe:
            return step(engine, batch)

    cells.train_step = probed
    try:
        run_cell(plan, torch.device("cuda"), compile=compile, steps=1)
    finally:
        cells.train_step = step
    return probe


def where(frames: list[dict], ours: bool) -> str:
    for f in frames:
        name = f["filename"]
        if not ours or "/zerofunc/" in name or "/sim/" in name:
            # inductor's generated code (a file under its cache): the line itself names the buffer
            text = linecache.getline(name, f["line"]).strip()[:100] if not ours and "torchinductor" in name else ""
            return f"{Path(name).parent.name}/{Path(name).name}:{f['line']} {f['name']}" + (f"  {text}" if text else "")
    return "(no project frame)" if ours else "(no frame)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--compile", choices=("no", "blocks", "whole"), default="no",
                   help="eager (no), each block compiled, or the step compiled whole")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--pickle", type=Path)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("error: this measures a CUDA GPU, and none is available", file=sys.stderr)
        return 2
    compile = {"no": False, "blocks": True, "whole": "whole"}[a.compile]
    plan = Plan(world_size=a.world_size, stage=a.stage, model=a.model, precision=a.precision,
                micro_batch=a.micro_batch, seq=a.seq, hardware=profile_for_device(torch.cuda.get_device_name()).name)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    marks: list[int] = []
    step, cells.train_step = measured_step_starts(marks)
    try:
        cell = run_cell(plan, torch.device("cuda"), compile=compile, steps=1)
    finally:
        cells.train_step = step
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if a.pickle:
        a.pickle.write_bytes(pickle.dumps(snap))
    trace = snap["device_traces"][torch.cuda.current_device()]
    if len(trace) >= 1_000_000:
        print("error: the allocator's trace filled its 1,000,000 entries: the step's peak may be cut off", file=sys.stderr)
        return 1
    # the measured step's: not the compiling first one's, nor the memory tracker's run after it
    peak, blocks = live_at_peak(trace, start=marks[1], end=marks[2] if len(marks) > 2 else None)
    print(f"{a.model} stage {a.stage} x {a.world_size}, {a.micro_batch} x {a.seq} tokens, "
          f"{ {'no': 'eager', 'blocks': 'blocks compiled', 'whole': 'compiled whole'}[a.compile]}: planned "
          f"{cell.planned_peak / MiB:.2f} MiB, measured {cell.measured_peak / MiB:.2f}, tracked "
          f"{cell.tracked_peak / MiB:.2f}, requested {cell.requested_peak / MiB:.2f}; trace peak {peak / MiB:.2f} MiB "
          f"in {len(blocks)} blocks, in the measured step ({len(trace)} trace entries, the step's from {marks[1]})")
    for ours in (True, False):
        groups = defaultdict(lambda: [0, 0])
        for b in blocks:
            g = groups[where(b.get("frames", []), ours)]
            g[0] += b["size"]
            g[1] += 1
        print(f"\nby innermost {'project ' if ours else ''}frame: MiB, blocks")
        for name, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:40]:
            print(f"{size / MiB:10.2f} {n:6d}  {name}")
    odd = [b["size"] for b in blocks if b["size"] % (2 * MiB) and b["size"] > MiB]
    print(f"\nblocks over 1 MiB: {sum(b['size'] > MiB for b in blocks)}; not a multiple of 2 MiB: {len(odd)}")
    if compile == "whole":
        return 0
    probe = op_transients(plan, compile)
    print(f"\nthe step's peak under the probe: {probe.peak / MiB:.2f} MiB, during {probe.peak_op} "
          f"(which held {probe.peak_transient / MiB:.2f} MiB only while it ran)")
    print("ops holding memory only while they run: calls, largest MiB")
    for name, (n, most) in sorted(probe.ops.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{most / MiB:10.2f} {n:6d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
