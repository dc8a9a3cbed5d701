"""What one rank does: build the engine, then step through the global batches."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from sim.memory import MemoryTracker
from train.data import load_tokens, rank_batch
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPT, model_config
from zerofunc.optim import AdamWConfig
from zerofunc.stages import get_stage
from zerofunc.step import train_step


@dataclass(frozen=True)
class TrainArgs:
    model: str
    stage: int
    nproc: int
    steps: int
    micro_batch: int
    seq: int
    lr: float
    dropout: float
    seed: int
    data: Optional[str]
    out: str
    device: str  # "cpu" or "cuda"


def rank_device(kind: str) -> torch.device:
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train_rank(args: TrainArgs) -> dict:
    """Train on this rank; rank 0 writes metrics.jsonl and prints a line per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(args.device)
    if device.type == "cpu":  # ranks share the cores; oversubscribing them slows every rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    tokens = load_tokens(args.data, args.seq)
    with torch.device("meta"):
        model = GPT(model_config(args.model, dropout=args.dropout))
    comm = DistCommunicator()
    # Peak memory: on CUDA the allocator's own count; on CPU the planner's tracker, on real tensors.
    tracker = MemoryTracker() if device.type == "cpu" else None
    engine = ZeroEngine(model, get_stage(args.stage), comm, AdamWConfig(lr=args.lr), device,
                        init=lambda name, shape: model.init_param(name, shape, args.seed), memory=tracker)
    metrics = _open_metrics(args.out) if rank == 0 else None
    tokens_per_step = args.micro_batch * world * args.seq
    start = time.perf_counter()
    loss_mean = float("nan")
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = [t.to(device) for t in rank_batch(tokens, step, args.micro_batch, world, rank, args.seq, args.seed)]
        comm.ledger.clear()
        if tracker is not None:
            tracker.reset_peak()
            with tracker:
                loss = train_step(engine, *batch)
        else:
            torch.cuda.reset_peak_memory_stats(device)
            loss = train_step(engine, *batch)
        loss_mean = loss.item()
        step_s = time.perf_counter() - t0
        if metrics is not None:
            row = {"step": step, "loss": loss_mean, "tokens": step * tokens_per_step, "time_s": step_s,
                   "elapsed_s": time.perf_counter() - start, "comm_volume_bytes": comm.ledger.volume_bytes(),
                   "peak_bytes": tracker.peak if tracker is not None else torch.cuda.max_memory_allocated(device)}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            print(f"step {step:5d}/{args.steps}  loss {loss_mean:.4f}  {tokens_per_step / step_s:9.0f} tok/s",
                  flush=True)
    if metrics is not None:
        metrics.close()
    return {"final_loss": loss_mean, "elapsed_s": time.perf_counter() - start}


def _open_metrics(out: str):
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return open(path / "metrics.jsonl", "w")
