"""Command line of python -m train. Bad input ends in one line on stderr and exit code 2.

Settings come from a DeepSpeed-style --config file when given; the flags override it.
Without a file, the flags (or their defaults) make the whole config.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from train import tensorboard
from train.data import DataError, check_vocab, load_corpus, val_batches
from train.flags import DEFAULTS, flag_defaults, overrides, parser
from train.lock import LockError, RunLock
from train.loop import TrainArgs, train_rank
from zerofunc.config import (MAX_BUCKET_MB, MAX_COMM_TIMEOUT_S, MAX_MICRO_BATCH_TOKENS, MAX_PREFETCH_DEPTH,
                             MAX_RANKS_PER_CORE, MAX_SEED, ConfigError, as_dict, compile_mode, parse as parse_config,
                             read as read_config)
from zerofunc.launch import (RankError, comm_failure_line, default_backend, init_torchrun, is_comm_failure, spawn,
                             under_torchrun)
from zerofunc import pretrained, whole_step
from zerofunc.checkpoint_files import CheckpointError, verify
from zerofunc.pretrained import WeightsError
from zerofunc.models import build_model, model_config
from zerofunc.lora import LoRA, apply_lora, lora_from_flags
from zerofunc.units import partition
from sim.hardware import use_profiles
from zerofunc.usage import UsageError

# exit codes: each fault its own, so that a job script can tell them apart
EXIT_RANK_FAILED = 1   # a rank raised, died, or a collective failed or timed out
EXIT_USAGE = 2         # bad input: flags, config, data, weights, checkpoint to resume, output directory in use
EXIT_NONFINITE = 3     # stopped at a step whose gradients were not finite, with the weights before it saved
EXIT_SAVE_FAILED = 4   # a checkpoint could not be written (--on-save-error stop); the previous one is intact
EXIT_PREEMPTED = 75    # stopped on SIGTERM/SIGINT with a checkpoint: run again with --resume (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130 # a second SIGINT/SIGTERM: stopped at once, nothing saved
EXIT_CODES = {"nonfinite": EXIT_NONFINITE, "save_failed": EXIT_SAVE_FAILED, "preempted": EXIT_PREEMPTED}


def parse(argv: list[str] | None) -> TrainArgs:
    a = parser().parse_args(argv)
    try:  # the ranks inherit the file through the environment, so they read what the planner reads
        use_profiles(a.profiles)
    except ValueError as e:
        raise UsageError(str(e)) from None

    if not 0 <= a.dropout < 1:
        raise UsageError(f"--dropout must lie in [0, 1), got {a.dropout}")
    a.model = _model_spec(a)
    try:
        model_cfg = model_config(a.model, dropout=a.dropout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if a.stage is not None and a.stage not in (0, 1, 2, 3):
        raise UsageError(f"--stage must be 0, 1, 2 or 3, got {a.stage}")
    if a.plot is not None and not a.plot.lower().endswith(".png"):
        raise UsageError(f"--plot writes a PNG; give a file name ending in .png, not {a.plot!r}")
    if a.plot is not None and not os.path.isdir(os.path.dirname(a.plot) or "."):  # drawn after the last step
        raise UsageError(f"--plot {a.plot!r}: its directory {os.path.dirname(a.plot)!r} does not exist")
    if a.save_every < 0:
        raise UsageError(f"--save-every must be >= 0, got {a.save_every}")
    for flag in ("nproc", "steps", "micro_batch", "grad_accum", "seq"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if a.lr is not None and not 0 < a.lr < float("inf"):
        raise UsageError(f"--lr must be positive and finite, got {a.lr}")
    if a.clip is not None and not 0 <= a.clip < float("inf"):
        raise UsageError(f"--clip must be >= 0 and finite, got {a.clip}")
    if a.timeout is not None and not 0 < a.timeout <= MAX_COMM_TIMEOUT_S:
        raise UsageError(f"--timeout must be a number of seconds in (0, {MAX_COMM_TIMEOUT_S}], got {a.timeout}")
    if a.prefetch_depth is not None and not 0 <= a.prefetch_depth <= MAX_PREFETCH_DEPTH:
        raise UsageError(f"--prefetch-depth must lie in [0, {MAX_PREFETCH_DEPTH}], got {a.prefetch_depth}")
    if a.bucket_mb is not None and not 0 <= a.bucket_mb <= MAX_BUCKET_MB:
        raise UsageError(f"--bucket-mb must lie in [0, {MAX_BUCKET_MB}], got {a.bucket_mb}")
    if not 0 <= a.seed < MAX_SEED:
        raise UsageError(f"--seed must lie in [0, {MAX_SEED}), got {a.seed}")
    if a.ac_every is not None and a.ac_every < 1:
        raise UsageError(f"--ac-every must be at least 1, got {a.ac_every}")
    if a.ac_every is not None and a.activation_checkpointing not in (None, "selective"):
        raise UsageError(f"--ac-every chooses the blocks of selective checkpointing, not {a.activation_checkpointing}")
    context = model_cfg.block_size
    if a.seq > context:
        raise UsageError(f"--seq {a.seq} is longer than {a.model}'s context of {context} tokens")
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is available")
    if device == "cuda" and not under_torchrun() and a.nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {a.nproc} exceeds the {torch.cuda.device_count()} CUDA devices here")
    cores = os.cpu_count() or 1  # each rank is a process with its own torch: past a few per core, memory runs out
    if device == "cpu" and not under_torchrun() and a.nproc > MAX_RANKS_PER_CORE * cores:
        raise UsageError(f"--nproc {a.nproc} is more CPU ranks than this machine holds: at most "
                         f"{MAX_RANKS_PER_CORE * cores} ({MAX_RANKS_PER_CORE} per core, {cores} cores)")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else a.nproc
    config = parse_config(as_dict(read_config(a.config) if a.config else flag_defaults(), overrides(a)), world)
    if config.micro_batch * a.seq > MAX_MICRO_BATCH_TOKENS:
        raise UsageError(f"a micro-batch of {config.micro_batch} x {a.seq} tokens is over the bound of "
                         f"{MAX_MICRO_BATCH_TOKENS} tokens per rank per micro-step; accumulate gradients instead")
    overlap = config.overlap
    if a.prefetch_depth is not None:
        overlap = replace(overlap, prefetch_depth=a.prefetch_depth)
    if a.bucket_mb is not None:
        overlap = replace(overlap, bucket_bytes=int(a.bucket_mb * 2**20))
    config = replace(config, overlap=overlap)
    for flag in ("eval_every", "eval_batches"):
        if getattr(a, flag) < (0 if flag == "eval_every" else 1):
            raise UsageError(f"--{flag.replace('_', '-')} must be at least {0 if flag == 'eval_every' else 1}, "
                             f"got {getattr(a, flag)}")
    compile = compile_mode(a.compile, config.compile, device)
    why = compile == "whole" and whole_step.refusal(
        config.offload_optimizer, config.shard_group is not None and config.stage > 0, config.hpz is not None,
        config.precision == "fp16", config.reduce_dtype is not None and config.reduce_dtype != config.precision)
    if why:
        raise UsageError(why)
    lora = _lora(a)
    with torch.device("meta"):
        model = build_model(model_cfg)
    if a.init_from is not None and not a.resume:
        pretrained.weights(a.init_from, model)  # names, shapes and files checked here, before any rank starts
    if lora is not None:  # its targets matched on the model built here, after its files were (they hold no adapter)
        try:
            apply_lora(model, lora)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if a.resume:  # the checkpoint's weights, not --init-from's; its frozen ones are the same --lora's
        verify(a.out, [([[n, list(p.shape)] for n, p in named if p.requires_grad],
                        [[n, list(p.shape)] for n, p in named if not p.requires_grad])
                       for _, _, named in partition(model, model.shard_units())])
    return TrainArgs(a.model, config, a.nproc, a.steps, a.seq, a.dropout, a.seed, a.data, a.out, device,
                     a.save_every, a.resume, a.plot, compile,
                     a.on_nonfinite, a.on_save_error, config.comm_timeout, a.init_from, a.eval_every,
                     a.eval_batches, a.tensorboard, lora)


def _lora(a: argparse.Namespace) -> Optional[LoRA]:
    """--lora's adapters (their targets are matched on the model by the caller); None without --lora."""
    try:
        lora = lora_from_flags(a)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return lora


def _model_spec(a: argparse.Namespace) -> str:
    """--model, else the model --init-from names (a model directory's config.json, a checkpoint's model)."""
    if a.init_from is None or a.model is not None:
        return a.model or DEFAULTS["model"]
    spec = pretrained.model_spec(a.init_from)
    if spec is None:
        raise UsageError(f"--init-from {a.init_from} names no model (no config.json beside the weights): "
                         f"give --model too")
    return spec


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        _check_data(args)  # fail here, in one line, rather than in every rank
    except (UsageError, DataError, ConfigError, CheckpointError, WeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.config.ignored:
        print(f"warning: zerofunc ignores these DeepSpeed settings: {', '.join(args.config.ignored)}", file=sys.stderr)
    backend = default_backend(torch.device(args.device))
    # the launcher owns the output directory; under torchrun, global rank 0 does
    lock = RunLock(args.out) if int(os.environ.get("RANK", "0")) == 0 else contextlib.nullcontext()
    try:
        with lock:
            if under_torchrun():
                results = [_torchrun_rank(args, backend)]
            else:
                results = spawn(train_rank, args.nproc, args, backend=backend, comm_timeout=args.comm_timeout)
    except LockError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RankError as e:
        if e.detail:  # not a known fault: the rank's traceback is what a bug report needs
            print(e.detail, file=sys.stderr, end="")
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE if e.bad_input else EXIT_RANK_FAILED
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if "stopped" in results[0]:
        kind, line = results[0]["stopped"]
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, every rank has the same line
            print(f"{'stopped' if kind == 'preempted' else 'error'}: {line}", file=sys.stderr)
        return EXIT_CODES[kind]
    return 0


def _check_data(args: TrainArgs) -> None:
    """The data fit the model, hold what evaluation needs, and the TensorBoard extra is there."""
    corpus = load_corpus(args.data, args.seq)
    check_vocab(corpus, model_config(args.model).vocab_size)
    if args.eval_every:
        val_batches(corpus, 1, 1, 1, 0, args.seq)
    if args.tensorboard is not None:
        tensorboard.check(args.tensorboard)


def _torchrun_rank(args: TrainArgs, backend: str) -> dict:
    """This process's rank of a torchrun world; a fault is told in one line, as the launcher does."""
    init_torchrun(backend, args.comm_timeout)
    try:
        return train_rank(args)
    except Exception as e:
        if is_comm_failure(e):
            raise RankError(comm_failure_line(dist.get_rank(), e)) from None
        if getattr(e, "bad_input", False):  # as the launcher tells it (zerofunc/launch.py)
            raise RankError(f"rank {dist.get_rank()}: {e}".splitlines()[0], bad_input=True) from None
        raise
