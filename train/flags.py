"""python -m train's flags: what each means, its default, and the config key it sets.

A flag given overrides the --config file's key (train/cli.py merges them); without a file the
flags' defaults describe the whole config (`flag_defaults`).
"""
from __future__ import annotations

import argparse

from zerofunc.lora import add_lora_flags
from zerofunc.models import MODELS
from zerofunc.overlap import Overlap
from zerofunc.recompute import MODES
from zerofunc.usage import PROFILES_HELP, ArgumentParser

DEFAULTS = dict(model="gpt2-tiny", stage=3, nproc=2, steps=1000, micro_batch=8, seq=128, lr=1e-3, seed=0)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m train", description="Train a GPT-2 or a Llama with ZeRO stages 0-3.")
    p.add_argument("--model", default=None,
                   help=f"a Hugging Face model directory or config.json (llama, mistral, qwen2, gpt2), or one of "
                        f"{', '.join(MODELS)} (default {DEFAULTS['model']}, or the model --init-from names)")
    p.add_argument("--init-from", metavar="PATH", default=None,
                   help="start from pretrained weights: a Hugging Face model directory (safetensors, sharded or "
                        "not), a .safetensors file (give --model too), or a zerofunc checkpoint or run directory; "
                        "each rank reads only its own shard")
    p.add_argument("--config", default=None, help="a DeepSpeed-style JSON config; the flags below override it")
    p.add_argument("--stage", type=int, default=None, help=f"ZeRO stage: 0, 1, 2 or 3 (default {DEFAULTS['stage']})")
    p.add_argument("--nproc", type=int, default=DEFAULTS["nproc"], help="ranks to start (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=None,
                   help=f"sequences per rank per micro-step (default {DEFAULTS['micro_batch']})")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--seq", type=int, default=DEFAULTS["seq"], help="tokens per sequence")
    p.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (default {DEFAULTS['lr']})")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None, help="default fp32")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the dtype gradients are accumulated and reduced in (default: --precision's; fp32 under "
                        "bf16 or fp16; config key communication_data_type)")
    p.add_argument("--clip", type=float, default=None, help="clip the global gradient norm to this (0: off)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout rate, seeded per global sample (default off)")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed of the initial weights and the data order")
    p.add_argument("--data", default=None,
                   help="a directory of tokens made by python -m train.prepare, or a file of training bytes "
                        "(default: the standard library's sources, as bytes)")
    p.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="every K steps (and after the last), the loss on the data's val.bin (0: never)")
    p.add_argument("--eval-batches", type=int, default=8, metavar="B",
                   help="global batches of val.bin to evaluate on, the same windows every time (default 8)")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also write the metrics as TensorBoard scalars to DIR (needs the tensorboard extra)")
    p.add_argument("--out", default="runs/latest", help="directory for metrics.jsonl and checkpoints")
    p.add_argument("--save-every", type=int, default=0, help="save a sharded checkpoint every K steps and after the last (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint under --out")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw the loss curve at the end")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    p.add_argument("--compile", nargs="?", const="blocks", choices=("blocks", "whole"), default=None,
                   help="torch.compile each block's compute (blocks, the default on CUDA), or the whole step with its "
                        "collectives (whole: stages 0-3 without offload, hpZ, hybrid sharding, fp16 or AC)")
    p.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                   help="run eagerly (the default on CPU)")
    add_lora_flags(p, "train")
    p.add_argument("--prefetch-depth", type=int, default=None,
                   help=f"stage 3: blocks gathered ahead of the one computing (default {Overlap.prefetch_depth})")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help=f"MiB of gradient reductions in flight before waiting (default {Overlap.bucket_bytes / 2**20:g}; "
                        "0: none)")
    p.add_argument("--activation-checkpointing", choices=MODES, default=None,
                   help="recompute blocks' forward in backward: every block (full), one in --ac-every (selective), every block but its attention's and every second matmul's outputs (selective-op)")
    p.add_argument("--ac-every", type=int, default=None, help="selective checkpointing: one block in K (default 2)")
    p.add_argument("--shard-group", type=int, default=None, metavar="S",
                   help="hybrid sharding: stages 1-3 shard within groups of S consecutive ranks and average each "
                        "gradient shard over the groups once per step (default: the whole world; config key "
                        "zero_optimization.shard_group_size)")
    p.add_argument("--hpz", type=int, default=None, metavar="K",
                   help="stage 3: keep 1/K of each block's weights after forward and gather backward's from K "
                        "consecutive ranks (a node) instead of the whole shard group (ZeRO++'s hpZ; config key "
                        "zero_optimization.zero_hpz_partition_size)")
    p.add_argument("--offload-optimizer", choices=("none", "cpu"), default=None,
                   help="cpu: the optimizer's state in host memory, its update on the CPU (stages 1-3)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="a step whose gradients hold an inf or a NaN (fp32, bf16) is never applied; stop: save the "
                        "weights before it and exit 3; skip: go on to the next step")
    p.add_argument("--on-save-error", choices=("stop", "continue"), default="stop",
                   help="a checkpoint that cannot be written (disk full, read-only, quota); stop: exit 4; continue: "
                        "train on and try again at the next save. The previous checkpoint stays intact either way")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before the run fails (default 300; "
                        "config key comm_timeout)")
    p.add_argument("--profiles", metavar="FILE", default=None,
                   help=PROFILES_HELP + "; on CPU, its cpu-gloo rates choose the collectives")
    return p


def flag_defaults() -> dict:
    """The config the flags' defaults describe, when no file is given."""
    return {"train_micro_batch_size_per_gpu": DEFAULTS["micro_batch"], "zero_optimization": {"stage": DEFAULTS["stage"]},
            "optimizer": {"type": "AdamW", "params": {"lr": DEFAULTS["lr"]}}}


def overrides(a: argparse.Namespace) -> dict:
    """The config keys that the given flags set."""
    out = {}
    if a.stage is not None:
        out["zero_optimization.stage"] = a.stage
    if a.micro_batch is not None or a.grad_accum is not None:
        out["train_micro_batch_size_per_gpu"] = a.micro_batch or DEFAULTS["micro_batch"]
        out["gradient_accumulation_steps"] = a.grad_accum or 1
        out["train_batch_size"] = None  # recomputed from the two flags
    if a.lr is not None:
        out["optimizer.params.lr"] = a.lr
    if a.clip is not None:
        out["gradient_clipping"] = a.clip
    if a.precision is not None:
        out["fp16.enabled"] = a.precision == "fp16"
        out["bf16.enabled"] = a.precision == "bf16"
    if a.reduce_dtype is not None:
        out["communication_data_type"] = a.reduce_dtype
    if a.activation_checkpointing is not None or a.ac_every is not None:
        out["activation_checkpointing.mode"] = a.activation_checkpointing or "selective"
    if a.ac_every is not None:
        out["activation_checkpointing.every"] = a.ac_every
    if a.offload_optimizer is not None:
        out["zero_optimization.offload_optimizer.device"] = a.offload_optimizer
    if a.shard_group is not None:
        out["zero_optimization.shard_group_size"] = a.shard_group
    if a.hpz is not None:
        out["zero_optimization.zero_hpz_partition_size"] = a.hpz
    if a.timeout is not None:
        out["comm_timeout"] = a.timeout
    return out
