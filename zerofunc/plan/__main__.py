"""python -m zerofunc.plan: which ZeRO stage fits, and what a step costs, before renting a GPU.

By default (`--levers auto`) it searches stage x activation checkpointing x optimizer
offload x micro-batch for the most tokens/s that fits; a lever given on the command line
is fixed, and `--levers none` plans each stage without levers at the given micro-batch.
The model may be a Hugging Face model directory, and the recommendation comes with the
python -m train command that fine-tunes it with every lever the plan chose (command.py).
Bad input prints one line, "error: ...", and exits with 2; nothing is written.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace

from sim.hardware import profiles, use_profiles
from zerofunc.lora import add_lora_flags, lora_from_flags
from zerofunc.config import MAX_BUCKET_MB, MAX_MICRO_BATCH_TOKENS, MAX_PREFETCH_DEPTH
from zerofunc.models import MODELS
from zerofunc.overlap import Overlap
from zerofunc.plan import Plan
from zerofunc.plan.plot import plot
from zerofunc.plan.report import GiB, as_json, as_table, recommend
from zerofunc.plan.search import fewest_ranks, lever_configs, lever_costs, report_stages, world_size_candidates
from zerofunc.plan.workers import shared_workers
from zerofunc.recompute import MODES
from zerofunc.usage import PROFILES_HELP, ArgumentParser, profiles_flag

MAX_AUTO_MICRO_BATCH = 64  # --levers auto without --micro-batch: the largest power of two that fits, up to this
# Bounds past which a plan would overflow torch's sizes or run for minutes; far beyond any real cluster
MAX_WORLD_SIZE = 2**20  # ranks: more accelerators than any cluster holds
MAX_PARAMS = 2**50      # --params: a thousand times the largest models trained
MAX_MEMORY_GIB = 2**20  # --gpu-memory, --host-memory: a PiB per rank
MAX_GRAD_ACCUM = 256    # --grad-accum: every micro-step is simulated, so the plan takes K times as long


def parse(argv: list[str] | None) -> argparse.Namespace:
    use_profiles(profiles_flag(argv))  # before the help lists them
    p = ArgumentParser(prog="python -m zerofunc.plan",
                       description="Simulate each ZeRO stage's per-rank memory and communication.")
    p.add_argument("--model", default="gpt2-small",
                   help=f"a Hugging Face model directory or its config.json (llama, mistral, qwen2, gpt2), "
                        f"or one of {', '.join(MODELS)}")
    p.add_argument("--params", type=int, default=None,
                   help="plan a model of N parameters with no architecture (model states only)")
    p.add_argument("--world-size", required=True,
                   help="data-parallel ranks: a number, a list (8,16,64), or auto (per stage, the fewest that fit)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node, for the network model (default: the hardware profile's); with --world-size "
                        "auto, past one node, try whole nodes only (default: powers of two)")
    p.add_argument("--max-world-size", type=int, default=4096, help="auto: the most ranks to try (default 4096)")
    p.add_argument("--stage", type=int, action="append", default=None,
                   help="a ZeRO stage to plan (repeatable; default: all four)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help=f"sequences per rank (default: with --levers auto the largest power of two that fits, up to "
                        f"{MAX_AUTO_MICRO_BATCH}; else 1)")
    p.add_argument("--levers", choices=("auto", "none"), default="auto",
                   help="auto: search activation checkpointing and optimizer offload (those not fixed below) and the "
                        "micro-batch; none: plan each stage with the levers given, off by default")
    p.add_argument("--activation-checkpointing", choices=MODES, default=None,
                   help="fix it: recompute every block (full), one in --ac-every (selective), or none")
    p.add_argument("--ac-every", type=int, default=2, help="selective checkpointing: one block in K (default 2)")
    p.add_argument("--offload-optimizer", choices=("none", "cpu"), default=None,
                   help="fix it: cpu keeps the optimizer's state and update on the host (stages 1-3)")
    p.add_argument("--host-memory", type=float, default=None,
                   help="host memory per rank in GiB, for offload (default: the hardware's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--shard-group", default=None, metavar="S",
                   help="hybrid sharding: stages 1-3 shard within groups of S consecutive ranks and average the "
                        "gradient shards over the groups once per step (default: the whole world); auto: the "
                        "smallest group that fits (a node, then whole nodes, dividing the world; --gpus-per-node sets a node), "
                        "then the fastest")
    p.add_argument("--hpz", type=int, default=None, metavar="K",
                   help="stage 3: backward gathers from groups of K consecutive ranks, each keeping 1/K of the "
                        "weights after forward (ZeRO++'s hpZ; default: off)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="micro-steps per optimizer step (default 1); the step planned runs all K")
    p.add_argument("--precision", default="bf16", help="fp32, bf16 or fp16")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the dtype gradients are accumulated and reduced in (default: --precision's; fp32 under "
                        "bf16 or fp16: DeepSpeed's communication_data_type, FSDP2's reduce_dtype)")
    p.add_argument("--hardware", default="h100-sxm", help=f"one of {', '.join(profiles())}")
    p.add_argument("--profiles", metavar="FILE", default=None, help=PROFILES_HELP)
    p.add_argument("--gpu-memory", type=float, default=None,
                   help="usable memory per rank in GiB (default: the hardware's, less its reserve)")
    p.add_argument("--prefetch-depth", type=int, default=Overlap.prefetch_depth,
                   help="stage 3: blocks gathered ahead of the one computing")
    p.add_argument("--bucket-mb", type=float, default=Overlap.bucket_bytes / 2**20,
                   help="MiB of gradient reductions in flight before waiting (0: none)")
    add_lora_flags(p, "plan", dropout=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw each stage's memory timeline")
    a = p.parse_args(argv)
    use_profiles(a.profiles)  # as the parser read it (an abbreviated --prof, say)
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse(argv)
        for flag, gib in (("--gpu-memory", a.gpu_memory), ("--host-memory", a.host_memory)):
            if gib is not None and not 0 < gib <= MAX_MEMORY_GIB:
                raise ValueError(f"{flag} must be positive, in GiB up to {MAX_MEMORY_GIB}, got {gib}")
        if a.micro_batch is not None and a.micro_batch < 1:
            raise ValueError(f"micro-batch must be at least 1, got {a.micro_batch}")
        if not 1 <= a.grad_accum <= MAX_GRAD_ACCUM:
            raise ValueError(f"--grad-accum must lie in [1, {MAX_GRAD_ACCUM}], got {a.grad_accum}")
        if a.params is not None and a.params > MAX_PARAMS:
            raise ValueError(f"--params must be at most {MAX_PARAMS}, got {a.params}")
        if not 0 <= a.prefetch_depth <= MAX_PREFETCH_DEPTH:
            raise ValueError(f"--prefetch-depth must lie in [0, {MAX_PREFETCH_DEPTH}], got {a.prefetch_depth}")
        if not 0 <= a.bucket_mb <= MAX_BUCKET_MB:
            raise ValueError(f"--bucket-mb must lie in [0, {MAX_BUCKET_MB}], got {a.bucket_mb}")
        if a.plot is not None and not a.plot.lower().endswith(".png"):
            raise ValueError(f"--plot writes a PNG; give a file name ending in .png, not {a.plot!r}")
        if a.plot is not None and not os.path.isdir(os.path.dirname(a.plot) or "."):  # before minutes of planning
            raise ValueError(f"--plot {a.plot!r}: its directory {os.path.dirname(a.plot)!r} does not exist")
        stages = sorted(set(a.stage)) if a.stage else [0, 1, 2, 3]
        shard_group, shard_auto = shard_group_arg(a.shard_group)
        if a.hpz is not None and a.hpz < 1:
            raise ValueError(f"--hpz must be at least 1, got {a.hpz}")
        sizes, candidates = world_sizes(a.world_size, a.gpus_per_node, a.max_world_size,
                                        math.lcm(shard_group or 1, a.hpz or 1))
        auto = a.levers == "auto"
        base = Plan(world_size=sizes[0], stage=stages[0], model=None if a.params is not None else a.model,
                    params=a.params, precision=a.precision, micro_batch=a.micro_batch or 1,
                    grad_accum=a.grad_accum, shard_group=shard_group, hpz=a.hpz, seq=a.seq,
                    hardware=a.hardware, prefetch_depth=a.prefetch_depth,
                    bucket_bytes=int(a.bucket_mb * 2**20),
                    activation_checkpointing=a.activation_checkpointing or "none", ac_every=a.ac_every,
                    offload_optimizer=a.offload_optimizer == "cpu", reduce_dtype=a.reduce_dtype,
                    lora=lora_from_flags(a), gpus_per_node=a.gpus_per_node)
        if base.lora is not None:
            base.build()  # the targets match something: refused here, in one line, not in every simulation
        if a.params is None and base.micro_batch * base.tokens > MAX_MICRO_BATCH_TOKENS:
            raise ValueError(f"a micro-batch of {base.micro_batch} x {base.tokens} tokens is over the bound of "
                             f"{MAX_MICRO_BATCH_TOKENS} tokens per rank")
        blocks = a.params is None  # a model of --params alone has no blocks to checkpoint
        checkpointing = ([a.activation_checkpointing or "none"] if a.activation_checkpointing or not auto
                         else ["none", "full", "selective"]) if blocks else ["none"]
        offload = [a.offload_optimizer == "cpu"] if a.offload_optimizer or not auto else [False, True]
        if a.offload_optimizer == "cpu" and stages == [0]:
            raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
        configs = lever_configs(base, stages, checkpointing, offload)  # each validates its stage and levers
        plans = [replace(c, world_size=n) for n in sizes for c in configs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    capacity = int(a.gpu_memory * GiB) if a.gpu_memory is not None else base.profile.usable_bytes
    host = int(a.host_memory * GiB) if a.host_memory is not None else base.profile.host_memory_bytes
    cap = MAX_AUTO_MICRO_BATCH if auto and a.micro_batch is None and blocks else None
    per_node = (a.gpus_per_node or base.profile.devices_per_node) if shard_auto else None
    with shared_workers(os.cpu_count() or 1):
        if auto and candidates is not None:
            # the fewest ranks any configuration fits on is where the most frugal one does; there, every one
            frugal = max(configs, key=lambda c: (c.stage, c.checkpointing.mode == "full", c.offload_optimizer))
            n = fewest_ranks(frugal, capacity, candidates, host, cap, shard_auto, workers=os.cpu_count() or 1)
            plans = [replace(c, world_size=n or candidates[-1]) for c in configs]
            reports = [replace(r, beyond=n is None)
                       for r in report_stages(plans, capacity, a.plot is not None, None, host, cap, per_node)]
        else:
            reports = report_stages(plans, capacity, a.plot is not None, candidates, host, cap, per_node)
        best = recommend(reports)
        costs = lever_costs(best) if auto and best is not None else []
    if a.plot is not None:
        try:
            plot(reports, a.plot)
        except OSError as e:
            print(f"error: cannot write {a.plot}: {e.strerror}", file=sys.stderr)
            return 2
    if candidates is not None:
        tried = (f"powers of two up to {a.max_world_size}" if a.gpus_per_node is None else
                 f"powers of two below {a.gpus_per_node}, then whole nodes of {a.gpus_per_node}, up to {a.max_world_size}")
        ranks = f"ranks: auto, the fewest that fit ({tried})"
    else:
        ranks = f"{sizes[0]} ranks" if len(sizes) == 1 else f"ranks: {', '.join(map(str, sizes))}"
    print(json.dumps(as_json(base, reports, capacity, costs, a.gpus_per_node), indent=2) if a.json else
          as_table(base, reports, capacity, ranks, costs, order=auto, micro_batch_auto=cap is not None,
                   gpus_per_node=a.gpus_per_node, shard_auto=shard_auto))
    return 0


def shard_group_arg(spec: str | None) -> tuple[int | None, bool]:
    """--shard-group: (the group's size, or None for the whole world or auto; whether it is auto)."""
    if spec is None or spec.strip().lower() == "auto":
        return None, spec is not None
    try:
        size = int(spec)
    except ValueError:
        raise ValueError(f"--shard-group takes a number of ranks or auto, not {spec!r}") from None
    if not 1 <= size <= MAX_WORLD_SIZE:
        raise ValueError(f"--shard-group must lie in [1, {MAX_WORLD_SIZE}], got {size}")
    return size, False


def world_sizes(spec: str, gpus_per_node: int | None, max_world_size: int,
                multiple_of: int = 1) -> tuple[list[int], list[int] | None]:
    """The world sizes to plan, and for `auto` the candidates to search (else None): with a fixed
    shard group or hpZ group, the multiples of both."""
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    if max_world_size < 1:
        raise ValueError(f"--max-world-size must be at least 1, got {max_world_size}")
    if max_world_size > MAX_WORLD_SIZE:
        raise ValueError(f"--max-world-size must be at most {MAX_WORLD_SIZE}, got {max_world_size}")
    if spec.strip().lower() == "auto":
        candidates = [n for n in world_size_candidates(max_world_size, gpus_per_node) if n % multiple_of == 0]
        if not candidates:
            raise ValueError(f"no world size to try is a multiple of {multiple_of} (--shard-group, --hpz), "
                             f"up to --max-world-size {max_world_size}")
        return candidates[:1], candidates
    try:
        sizes = sorted({int(part) for part in spec.split(",")})
    except ValueError:
        raise ValueError(f"--world-size takes a number, a comma-separated list or auto, not {spec!r}") from None
    if sizes[0] < 1:
        raise ValueError(f"world size must be at least 1, got {sizes[0]}")
    if sizes[-1] > MAX_WORLD_SIZE:
        raise ValueError(f"world size must be at most {MAX_WORLD_SIZE}, got {sizes[-1]}")
    return sizes, None


if __name__ == "__main__":
    sys.exit(main())
