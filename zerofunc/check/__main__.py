"""python -m zerofunc.check: does the trainer do what the planner predicts, here, at the world sizes you plan for?

It prints the environment, then for each stage and world size runs a few real training
steps as rank 0 of a simulated world (PyTorch's fake process group, see world.py) next
to the planner's simulation of the same step, and compares peak memory and the
collectives. It exits 1, naming the cells, when the communication differs by a byte or
a peak falls outside the tolerance; bad input prints one line, "error: ...", and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch

from sim.hardware import get_profile, profile_for_device, record_measured, use_profiles
from zerofunc import allocator
from zerofunc.check.env import as_text, environment
from zerofunc.lora import add_lora_flags, lora_from_flags
from zerofunc.models import MODELS
from zerofunc.plan import Plan
from zerofunc.recompute import MODES as CHECKPOINTING_MODES
from zerofunc.usage import PROFILES_HELP, ArgumentParser

MiB = 2**20


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m zerofunc.check",
                                description="Check the planner against real training steps in simulated worlds.")
    p.add_argument("--model", default="gpt2-tiny",
                   help=f"a Hugging Face config.json (llama, mistral, qwen2, gpt2), or one of {', '.join(MODELS)}")
    p.add_argument("--world-sizes", default="1,8,64", help="comma-separated ranks of the simulated worlds")
    p.add_argument("--stage", type=int, action="append", default=None, help="a ZeRO stage (repeatable; default all)")
    p.add_argument("--shard-group", type=int, default=None, metavar="S",
                   help="hybrid sharding: stages 1-3 shard within groups of S consecutive ranks, the gradient shards "
                        "averaged over the groups (S must divide every world size; default: the whole world)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--precision", default=None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the dtype gradients reduce in (default: --precision's; communication_data_type)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    p.add_argument("--hardware", default=None, help="the profile to plan with (default: the device's)")
    p.add_argument("--activation-checkpointing", choices=CHECKPOINTING_MODES, default="none",
                   help="the blocks' checkpointing in every cell (selective: one block in 2)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile each block's compute")
    p.add_argument("--steps", type=int, default=2, help="measured steps per cell")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest relative peak difference that passes")
    add_lora_flags(p, "check", dropout=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--json-out", metavar="FILE", default=None, help="also write the JSON to FILE")
    p.add_argument("--calibrate", action="store_true",
                   help="CUDA: measure the matmul rates and HBM bandwidth, write them into the device's profile in "
                        "the user's profiles file (--profiles), exit")
    p.add_argument("--profiles", metavar="FILE", default=None,
                   help=PROFILES_HELP + "; --calibrate writes there, creating it")
    return p.parse_args(argv)


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--world-sizes takes positive integers separated by commas, got {text!r}")
    return sorted(set(sizes))


def _setup(a: argparse.Namespace) -> tuple[torch.device, list[Plan]]:
    """The device and the plans to check, or ValueError naming what is wrong."""
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA device is available")
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if cuda:
        allocator.configure(torch.device("cuda"))  # as the trainer runs it, before the first allocation
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if a.json_out is not None and not Path(a.json_out).resolve().parent.is_dir():
        raise ValueError(f"--json-out {a.json_out}: its directory does not exist")
    if a.steps < 1 or not a.tolerance >= 0:
        raise ValueError(f"need --steps >= 1 and --tolerance >= 0, got {a.steps} and {a.tolerance}")
    hardware = a.hardware or (profile_for_device(torch.cuda.get_device_name(device)).name if cuda else "cpu-gloo")
    precision = a.precision or ("bf16" if cuda else "fp32")
    stages = sorted(set(a.stage)) if a.stage else [0, 1, 2, 3]
    if a.shard_group is not None and a.shard_group < 1:
        raise ValueError(f"--shard-group must be at least 1, got {a.shard_group}")
    plans = [Plan(world_size=ws, stage=s, model=a.model, precision=precision, micro_batch=a.micro_batch, seq=a.seq,
                  hardware=hardware, shard_group=a.shard_group, reduce_dtype=a.reduce_dtype, lora=lora_from_flags(a),
                  activation_checkpointing=a.activation_checkpointing)
             for s in stages for ws in _world_sizes(a.world_sizes)]
    plans[0].build()  # --lora's targets match a layer: refused here, in one line
    return device, plans


def calibrate(device: torch.device, hardware: str | None) -> int:
    from zerofunc.check.calibrate import measure

    if device.type != "cuda":
        print("error: --calibrate measures a CUDA GPU; the CPU profile comes from benchmarks/measure_cpu_profile.py",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device)
    profile = get_profile(hardware) if hardware else profile_for_device(name)
    figures = measure(device)
    try:  # into the user's profiles file (sim.hardware.user_path), never into the package
        path = record_measured(profile.name, figures, f"measured {date.today()} on {name} with torch "
                               f"{torch.__version__} by python -m zerofunc.check --calibrate: median torch.mm of "
                               "8192^2 matrices per dtype (fp32 without TF32), a 2 GiB device copy counted as read "
                               "plus write, total_memory")
    except OSError as e:
        print(f"error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"profile": profile.name, "file": str(path), **figures}, indent=2))
    return 0


def _row(cell, cuda: bool) -> list[str]:
    row = [str(cell.stage), str(cell.world_size), str(cell.shard_group), f"{cell.planned_peak / MiB:.2f}", f"{cell.measured_peak / MiB:.2f}",
           f"{cell.peak_ratio:.4f}", f"{cell.planned_comm:,}", f"{cell.measured_comm:,}",
           "yes" if cell.ledger_equal else "NO"]
    if cuda:
        row += [f"{cell.tracked_peak / MiB:.2f}", f"{cell.requested_peak / MiB:.2f}", f"{cell.held_before / MiB:.2f}",
                f"{cell.reserved / MiB:.2f}", f"{cell.reserved_peak / MiB:.2f}", f"{cell.planned_compute_s * 1e3:.2f}",
                f"{cell.planned_step_s * 1e3:.2f}", f"{cell.measured_step_s * 1e3:.2f}"]
    return row


COLUMNS = ["stage", "ranks", "shard group", "planned peak MiB", "measured peak MiB", "ratio", "planned comm B", "executed comm B",
           "same collectives"]
CUDA_COLUMNS = ["tracked peak MiB", "requested peak MiB", "held before MiB", "reserved MiB", "peak reserved MiB",
                "planned compute ms", "planned step ms", "measured step ms"]


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse(argv)  # argparse's own complaints too: one line, exit 2
        use_profiles(a.profiles, must_exist=not a.calibrate)  # a bad file: one line, before any measuring
        device, plans = _setup(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.calibrate:
        return calibrate(device, a.hardware)
    from zerofunc.check.cells import run_cell  # the heavy imports, after the input is known to be good

    cuda = device.type == "cuda"
    env = environment(device, a.compile)
    first = plans[0]
    what = (f"{first.model}, micro-batch {first.micro_batch} x {first.tokens} tokens, {first.precision}, "
            f"activation checkpointing {first.activation_checkpointing}, "
            f"planned with profile {first.hardware}, {a.steps} measured steps per cell, tolerance {a.tolerance:.0%}")
    columns = COLUMNS + (CUDA_COLUMNS if cuda else [])
    widths = [len(c) for c in columns]
    if not a.json:
        print(as_text(env), "", what, "", "  ".join(columns), sep="\n", flush=True)
    cells, failed = [], []
    for plan in plans:
        try:
            cell = run_cell(plan, device, compile=a.compile, steps=a.steps)
        except torch.cuda.OutOfMemoryError:
            failed.append(f"stage {plan.stage} x {plan.world_size} ranks: out of memory")
            torch.cuda.empty_cache()
            continue
        cells.append(cell)
        failed += [f"stage {cell.stage} x {cell.world_size} ranks: {why}" for why in cell.failures(a.tolerance)]
        if not a.json:
            print("  ".join(v.rjust(w) for v, w in zip(_row(cell, cuda), widths)), flush=True)
    worst = max(cells, key=lambda c: abs(c.peak_ratio - 1), default=None)
    doc = json.dumps({"environment": env, "model": first.model, "micro_batch": first.micro_batch, "seq": first.tokens,
                      "precision": first.precision, "hardware": first.hardware, "compile": a.compile,
                      "activation_checkpointing": first.activation_checkpointing,
                      "tolerance": a.tolerance, "cells": [c.as_json() for c in cells],
                      "worst_peak_ratio": worst.peak_ratio if worst else None, "failures": failed}, indent=2)
    if a.json_out:
        tmp = Path(a.json_out).with_name(f".{Path(a.json_out).name}.partial")
        tmp.write_text(doc + "\n")
        tmp.replace(a.json_out)
    if a.json:
        print(doc)
    else:
        print()
        if worst is not None:
            print(f"worst peak: stage {worst.stage} x {worst.world_size} ranks, planned/measured {worst.peak_ratio:.4f}")
        print("measured: " + ("torch.cuda.max_memory_allocated of each step" if cuda else
                              "the memory tracker on the real tensors of each step")
              + "; comm: the volume sent, an all-reduce of S bytes counting 2S")
    if failed:
        print("check failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    if not a.json:
        print(f"ok: {len(cells)} cells, the same collectives to the byte, every peak within {a.tolerance:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
