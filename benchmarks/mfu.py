"""Tokens/s and model FLOPs utilization of a `python -m train` run, from its metrics.jsonl.

    python benchmarks/mfu.py runs/latest/metrics.jsonl --model gpt2-small --seq 128 [--hardware h100-sxm]
    python benchmarks/mfu.py runs/latest/metrics.jsonl --model benchmarks/models/gpt2-30m.json --seq 128

Training FLOPs per token are 6N for the weights (forward 2N, backward 4N) plus
12 * layers * width * seq for attention's scores and values (PaLM, appendix B). The
rate is the profile's bf16 matmul rate: measured where `python -m zerofunc.check
--calibrate` has run on the device, published otherwise (the profile's sources say
which); by default the profile of this machine's GPU. Steps before --skip (compilation, warm-up) are left out; tokens/s is the median.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sim.hardware import get_profile, profile_for_device  # noqa: E402
from zerofunc.models import GPT, GPTConfig, model_config  # noqa: E402
from zerofunc.models.gpt2 import MODELS as GPT_PRESETS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", type=Path)
    p.add_argument("--model", required=True, help=f"the run's --model: a GPT-2 preset ({', '.join(GPT_PRESETS)}) or "
                   "config.json (benchmarks/models/ holds the CPU harness's 30m and 120m shapes)")
    p.add_argument("--seq", type=int, required=True, help="the run's --seq")
    p.add_argument("--nproc", type=int, default=1, help="the run's ranks (one device each)")
    p.add_argument("--hardware", help="a profile name (default: the profile of this machine's GPU)")
    p.add_argument("--skip", type=int, default=5, help="leading steps left out")
    a = p.parse_args(argv)
    try:
        rows = [json.loads(line) for line in a.metrics.read_text().splitlines()]
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: cannot read {a.metrics}: {e}", file=sys.stderr)
        return 2
    timed = rows[a.skip:]
    if not timed:
        print(f"error: {a.metrics} has {len(rows)} steps, none after --skip {a.skip}", file=sys.stderr)
        return 2
    try:
        cfg = model_config(a.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not isinstance(cfg, GPTConfig):
        print(f"error: {a.model}: this counts GPT-2's FLOPs, and the model is {cfg.model_type}", file=sys.stderr)
        return 2
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())  # the head is tied: counted once
    per_token = 6 * n + 12 * cfg.n_layer * cfg.n_embd * a.seq
    tokens_per_step = rows[0]["tokens"]
    tokens_per_s = statistics.median(tokens_per_step / r["time_s"] for r in timed)
    try:
        if a.hardware is None and not torch.cuda.is_available():
            raise ValueError("no GPU here to take the profile from: name one with --hardware")
        profile = get_profile(a.hardware) if a.hardware else profile_for_device(torch.cuda.get_device_name())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = profile.flops["bf16"]
    source = next((v for k, v in profile.sources.items() if "flops" in k), "")
    print(f"{a.model} ({n / 1e6:.1f}M parameters), seq {a.seq}, {len(timed)} steps after {a.skip}: "
          f"{tokens_per_s:,.0f} tokens/s, {tokens_per_s * per_token / 1e12:.1f} TFLOP/s, "
          f"MFU {tokens_per_s * per_token / (rate * a.nproc):.1%} of {a.nproc} x {rate / 1e12:.0f} TFLOP/s bf16 ({profile.name}: {source[:60]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
