"""The command that runs a plan: python -m train with every flag the plan chose, under the trainer's
own flag names, so that what was planned is what gets trained.

A model directory (config.json and its safetensors weights) is a fine-tune: `--init-from DIR`
loads its weights, and implies `--model DIR`. A preset or a config.json starts from random
weights: `--model SPEC`. The data are a placeholder, DATA_DIR, for a directory
`python -m train.prepare` wrote. Past one node of GPUs the command is torchrun's, run on each node.
The planner cannot import the trainer (it sits a layer above), so tests/test_plan_dir.py holds the
two together: every command printed here parses with train/cli.py into the plan's own config.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

from zerofunc.models import is_config_path
from zerofunc.overlap import Overlap
from zerofunc.plan import Plan

DATA = "DATA_DIR"  # a directory of tokens from python -m train.prepare
HOST = "HOST0"     # torchrun's rendezvous: any one of the nodes


def train_args(plan: Plan, nproc: Optional[int] = None) -> list[str]:
    """python -m train's arguments for `plan`; `--nproc` when given (not under torchrun)."""
    spec = plan.model
    model = ["--init-from", spec] if is_config_path(spec) and Path(spec).is_dir() else ["--model", spec]
    args = [*model, "--data", DATA, "--stage", str(plan.stage)]
    if nproc is not None:
        args += ["--nproc", str(nproc)]
    args += ["--micro-batch", str(plan.micro_batch), "--seq", str(plan.tokens), "--precision", plan.precision]
    if plan.reduce_dtype not in (None, plan.precision):
        args += ["--reduce-dtype", plan.reduce_dtype]
    if plan.grad_accum > 1:
        args += ["--grad-accum", str(plan.grad_accum)]
    if plan.hybrid_group is not None:
        args += ["--shard-group", str(plan.hybrid_group)]
    if plan.hpz_group is not None:
        args += ["--hpz", str(plan.hpz_group)]
    ac = plan.checkpointing
    if ac.on:
        args += ["--activation-checkpointing", ac.mode]
        if ac.mode == "selective":
            args += ["--ac-every", str(ac.every)]
    if plan.offload_optimizer:
        args += ["--offload-optimizer", "cpu"]
    if plan.lora is not None:
        args += ["--lora", str(plan.lora.r), "--lora-alpha", repr(plan.lora.alpha), "--lora-targets", plan.lora.targets]
    if plan.prefetch_depth != Overlap.prefetch_depth:
        args += ["--prefetch-depth", str(plan.prefetch_depth)]
    if plan.bucket_bytes != Overlap.bucket_bytes:
        args += ["--bucket-mb", repr(plan.bucket_bytes / 2**20)]  # exact: a power of two divides it
    if not plan.profile.device_names:  # a CPU profile: gloo ranks, even where a GPU is there
        args += ["--device", "cpu"]
    # The plan simulated the eager step (zerofunc/plan/report.py's EAGER_NOTE); the trainer compiles by default
    # on CUDA, which changes kernels, activations and time.
    args += ["--no-compile"]
    return args


def nodes(world_size: int, per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) for `world_size` ranks on nodes of at most `per_node` devices:
    the fewest equal nodes."""
    per = max(d for d in range(1, min(world_size, per_node) + 1) if world_size % d == 0)
    return world_size // per, per


def command(plan: Plan, gpus_per_node: Optional[int] = None) -> Optional[list[str]]:
    """The argv that trains `plan` (None for a plan the trainer cannot run: --params alone, or a
    model given as an object rather than a name or a path). On a GPU profile, a world larger than
    a node (`gpus_per_node`, else the profile's) runs under torchrun, the same argv on each node."""
    if plan.params is not None or not isinstance(plan.model, str):
        return None
    per_node = gpus_per_node or plan.profile.devices_per_node
    if not plan.profile.device_names or plan.world_size <= per_node:
        return ["python", "-m", "train", *train_args(plan, plan.world_size)]
    n, per = nodes(plan.world_size, per_node)
    return ["torchrun", "--nnodes", str(n), "--nproc_per_node", str(per), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"{HOST}:29500", "--rdzv_id", "RUN", "-m", "train", *train_args(plan)]


def command_lines(plan: Plan, gpus_per_node: Optional[int] = None) -> list[str]:
    """The table's lines that say how to run `plan` (none when the trainer cannot)."""
    argv = command(plan, gpus_per_node)
    if argv is None:
        return []
    where = f", on each of {argv[2]} nodes ({HOST}: any one of them)" if argv[0] == "torchrun" else ""
    return [f"to train it{where}, with {DATA} a directory that python -m train.prepare wrote:", f"  {shlex.join(argv)}"]
