"""What one rank does: build the engine, then step through the global batches."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

import zerofunc
from sim.memory import MemoryTracker
from train.data import load_corpus, rank_batch, val_batches
from train.evaluate import evaluate
from train.tensorboard import TensorBoardLog
from train.preempt import StopAgreement
from train.report import Progress, plot_loss, summary
from zerofunc import allocator, checkpoint, pretrained
from zerofunc.checkpoint import SaveError
from zerofunc.checkpoint_files import step_dir
from zerofunc.config import Config
from zerofunc.launch import mark_step
from zerofunc.lora import LoRA, WithAdapters, apply_lora
from zerofunc.models import build_model, model_config
from zerofunc.step import step as zero_step


@dataclass(frozen=True)
class TrainArgs:
    model: str
    config: Config  # stage, batch sizes, precision, optimizer, clipping, schedule
    nproc: int
    steps: int
    seq: int
    dropout: float
    seed: int
    data: Optional[str]
    out: str
    device: str  # "cpu" or "cuda"
    save_every: int = 0   # save a checkpoint every K steps (0: never)
    resume: bool = False  # continue from the newest checkpoint under `out`
    plot: Optional[str] = None  # draw the loss curve to this PNG at the end
    compile: bool | str = False  # False, "blocks" (torch.compile each block's compute) or "whole" (the step)
    on_nonfinite: str = "stop"  # a step whose gradients hold an inf or a NaN: "stop" the run, or "skip" the step
    on_save_error: str = "stop"  # a checkpoint that cannot be written: "stop" the run, or "continue" without it
    comm_timeout: float = 300.0  # seconds a collective may wait for the other ranks before it fails
    init_from: Optional[str] = None  # pretrained weights: a model directory, a .safetensors file or a checkpoint
    eval_every: int = 0          # the loss on val.bin every K steps and after the last (0: never)
    eval_batches: int = 8        # global batches of val.bin per evaluation
    tensorboard: Optional[str] = None  # also write the metrics as TensorBoard scalars here
    lora: Optional[LoRA] = None  # train LoRA adapters on the frozen model (zerofunc/lora.py)


def rank_device(kind: str) -> torch.device:
    if kind == "cuda":
        allocator.configure(torch.device("cuda"))  # before the rank's first CUDA allocation
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
    corpus = load_corpus(args.data, args.seq)
    with torch.device("meta"):
        model = build_model(model_config(args.model, dropout=args.dropout))
    # Peak memory: on CUDA the allocator's own count; on CPU the planner's tracker, on real tensors.
    tracker = MemoryTracker() if device.type == "cpu" else None
    cfg = args.config
    if args.init_from is not None and not args.resume:  # each rank reads its own shard of the files
        init = pretrained.weights(args.init_from, model)
    else:
        init = lambda name, shape: model.init_param(name, shape, args.seed)  # noqa: E731
    if args.lora is not None:  # after the weights' files are matched to the model: the adapters are not in them
        apply_lora(model, args.lora)
        init = WithAdapters(init, args.seed)
    # initialize makes the communicators: the world's, or with --shard-group the shard and replica groups
    engine = zerofunc.initialize(model, cfg, device=device, memory=tracker, compile=args.compile, init=init)
    comm = engine.comm  # its ledger is the step's, the replicas' collectives included
    first = 1
    if args.resume:
        first = checkpoint.load(engine, args.out)["step"] + 1
    state = engine.state  # the optimizer's state: into each step, and out of it (zerofunc/state.py)
    saved = first - 1 if args.resume else None  # the step of the newest checkpoint of this run
    stop = StopAgreement()
    metrics = _open_metrics(args.out, keep_through=first - 1) if rank == 0 else None
    board = TensorBoardLog(args.tensorboard, first) if rank == 0 and args.tensorboard else None
    held_out = ([[t.to(device) for t in batch]
                 for batch in val_batches(corpus, args.eval_batches, cfg.micro_batch, world, rank, args.seq)]
                if args.eval_every else None)
    tokens_per_step = cfg.train_batch_size * args.seq
    progress = Progress(first, args.steps) if rank == 0 else None
    start = time.perf_counter()
    loss_mean = float("nan")
    totals = {"peak_bytes": 0, "comm_bytes": 0, "tokens": 0,
              "whole_on_cpu": args.compile == "whole" and tracker is not None}
    for step in range(first, args.steps + 1):
        mark_step(step)
        if stop.stop_before(step):
            totals["stopped"] = _stop_preempted(engine, args, step - 1, saved, stop.agreed[1], state)
            break
        t0 = time.perf_counter()
        micro_batches = [[t.to(device) for t in rank_batch(corpus, step, cfg.micro_batch, world, rank, args.seq,
                                                           args.seed, cfg.grad_accum, j)]
                         for j in range(cfg.grad_accum)]
        comm.ledger.clear()
        if tracker is not None:
            tracker.reset_peak()
            # entered, the tracker (a dispatch mode) would make torch.compile run the step compiled whole eagerly:
            # that step's peak is the engine's buffers only, as the summary says
            with tracker if engine.whole is None else contextlib.nullcontext():
                after, done = zero_step(engine, state, micro_batches)
        else:
            torch.cuda.reset_peak_memory_stats(device)
            after, done = zero_step(engine, state, micro_batches)
        loss_mean = done.loss.item()
        skipped = after.nonfinite > state.nonfinite  # the same on every rank: the norm is global
        state = after
        step_s = time.perf_counter() - t0
        peak = tracker.peak if tracker is not None else torch.cuda.max_memory_allocated(device)
        volume = comm.ledger.volume_bytes()
        val_loss = None
        if held_out is not None and (step % args.eval_every == 0 or step == args.steps):
            val_loss = evaluate(engine, held_out)  # after the step's own figures: its collectives are not counted
        totals["peak_bytes"] = max(totals["peak_bytes"], peak)
        totals["comm_bytes"] += volume
        totals["tokens"] += tokens_per_step
        if metrics is not None:
            row = {"step": step, "loss": loss_mean, "tokens": step * tokens_per_step, "time_s": step_s,
                   "elapsed_s": time.perf_counter() - start, "comm_volume_bytes": volume, "peak_bytes": peak,
                   "lr": cfg.lr(max(state.steps, 1)), "grad_norm": done.grad_norm}
            if val_loss is not None:
                row |= {"val_loss": val_loss}
            if state.loss_scale is not None:
                row |= {"loss_scale": state.loss_scale.scale, "skipped_steps": state.skipped}
            if skipped:
                row |= {"nonfinite": True}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if board is not None:
                board.write(row)
            progress.update(step, loss_mean, tokens_per_step / step_s, peak, val_loss)
        if skipped and args.on_nonfinite == "stop":
            totals["stopped"] = _stop_nonfinite(engine, args, step, loss_mean, saved, state)
            break
        if args.save_every and (step % args.save_every == 0 or step == args.steps):  # the last step too
            try:
                _save(engine, args, step, state)
                saved = step
            except SaveError as e:
                if args.on_save_error == "stop":
                    totals["stopped"] = ("save_failed", f"{e}; stopped, {_newest(args, saved)}")
                    break
                if rank == 0:
                    print(f"warning: {e}; going on without it (--on-save-error continue)", file=sys.stderr,
                          flush=True)
    totals |= {"final_loss": loss_mean, "elapsed_s": time.perf_counter() - start}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, totals)  # every rank's peak, for the summary
    if rank == 0:
        metrics.close()
        progress.close()
        if board is not None:
            board.close()
        if args.steps >= first and "stopped" not in totals:
            print(summary(per_rank, args.steps - first + 1), flush=True)
        if args.plot:
            plot_loss(Path(args.out) / "metrics.jsonl", Path(args.plot))
    return totals


def _stop_nonfinite(engine, args: TrainArgs, step: int, loss: float, saved, state) -> tuple[str, str]:
    """The step was skipped, so the weights are still those of the step before it: save them, and
    say so in the run's last line."""
    why = f"step {step}: the loss is {loss} and the gradients are not finite"
    # A resume runs step `step` again, so the checkpoint of the step before must not count it as
    # skipped yet (one saved there by --save-every does not): the count then resumes exactly.
    state = replace(state, nonfinite=state.nonfinite - 1)
    return _final_save(engine, args, step - 1, saved, why, f"stopped with the weights of step {step - 1}",
                       "nonfinite", " (--on-nonfinite skip skips such steps)", state)


def _stop_preempted(engine, args: TrainArgs, last: int, saved, signal_name: str, state) -> tuple[str, str]:
    return _final_save(engine, args, last, saved, f"{signal_name} received", f"stopped after step {last}", "preempted",
                       "; continue with --resume", state)


def _final_save(engine, args: TrainArgs, last: int, saved, why: str, what: str, kind: str,
                advice: str, state) -> tuple[str, str]:
    """Save the weights of step `last` as the run stops (unless that checkpoint exists already):
    the (kind, line) the launcher reports."""
    if last < 1:
        return kind, f"{why}; {what}: no step was completed, nothing to save{advice}"
    if saved != last:
        try:
            _save(engine, args, last, state)
        except SaveError as e:
            return "save_failed", f"{why}; {what}, but {e}; {_newest(args, saved)}"
    return kind, f"{why}; {what}, its checkpoint is {step_dir(args.out, last)}{advice}"


def _newest(args: TrainArgs, saved) -> str:
    return (f"the newest checkpoint is {step_dir(args.out, saved)}" if saved
            else "there is no checkpoint of this run")


def _save(engine, args: TrainArgs, step: int, state) -> Path:
    extra = {"model": args.model, "seed": args.seed, "lora": asdict(args.lora) if args.lora else None,
             "init_from": str(Path(args.init_from).resolve()) if args.init_from else None}
    return checkpoint.save(engine, args.out, step, extra=extra, state=state)


def _open_metrics(out: str, keep_through: int):
    """metrics.jsonl for appending, keeping the rows of steps <= `keep_through` (0: a new file).

    A resumed run continues the same file; rows a killed run wrote after its last
    checkpoint are dropped, since those steps run again.
    """
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    file = path / "metrics.jsonl"
    kept = []
    if keep_through and file.exists():
        kept = [line for line in file.read_text().splitlines() if json.loads(line)["step"] <= keep_through]
    file.write_text("".join(line + "\n" for line in kept))
    return open(file, "a")
