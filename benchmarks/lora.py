"""LoRA next to a full fine-tune of the same model, and zerofunc's LoRA next to PEFT's on its peers (issue 32).

    python benchmarks/lora.py --model tiny|30m|120m [--r R] [--steps K] [--warmup W] [--repeat R] [--impl NAME ...]

The GPT, data, seed, optimizer and 2 gloo ranks of benchmarks/peers.py, fp32. Implementations:
  zerofunc-full-S    the full fine-tune at ZeRO stage S (0 or 3): every weight trained;
  zerofunc-lora-S    zerofunc.lora.apply_lora(model, LoRA(R, alpha 2R, all-linear)) at stage S;
  peft-ddp           peft.get_peft_model on the same layers, PyTorch DDP, torch's AdamW (~ stage 0);
  peft-fsdp2         the same, FSDP2 `fully_shard` per block and the root, reshard_after_forward (~ stage 3);
  fsdp2-full         the full fine-tune on FSDP2, reshard_after_forward: the peer's own LoRA saving.

The adapters start from the same values in every LoRA run (zerofunc's draw, copied into PEFT's lora_A;
lora_B zeros), so the LoRA runs' losses agree to rounding. Interleaved runs, medians and peak RSS as in
peers.py. Reported: each run's step time and peak resident memory; LoRA over full (what LoRA saves: the
frozen weights' gradient matmuls, reductions and optimizer); zerofunc's LoRA over PEFT's at its stage.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `train` and `benchmarks` at the repo root

import torch

from benchmarks.peer_steps import torch_step  # noqa: E402
from benchmarks.peers import (MICRO_BATCH, MODELS, OPT, SEED, SEQ, WORLD, _fmt_mib, _peak_rss_bytes,  # noqa: E402
                              build_model)

IMPLS = {  # name -> (family, stage or FSDP2's reshard_after_forward, stage it compares with, LoRA)
    "zerofunc-full-0": ("zerofunc", 0, 0, False),
    "zerofunc-lora-0": ("zerofunc", 0, 0, True),
    "peft-ddp": ("ddp", None, 0, True),
    "zerofunc-full-3": ("zerofunc", 3, 3, False),
    "zerofunc-lora-3": ("zerofunc", 3, 3, True),
    "peft-fsdp2": ("fsdp2", True, 3, True),
    "fsdp2-full": ("fsdp2", True, 3, False),
}


def lora_model(model_name: str, r: int):
    """The benchmark's GPT with zerofunc's adapters (the rank's torch seed fixed: the same draw everywhere);
    the LoRA and the adapted layers' names."""
    from zerofunc.lora import LoRA, apply_lora
    torch.manual_seed(SEED)
    model, lora = build_model(model_name), LoRA(r, alpha=2.0 * r)
    return model, lora, apply_lora(model, lora)


def peft_model(model_name: str, r: int):
    """PEFT's LoRA on the same layers, its adapters set to zerofunc's starting values."""
    import peft
    ours, lora, names = lora_model(model_name, r)
    model = peft.get_peft_model(build_model(model_name), peft.LoraConfig(r=r, lora_alpha=lora.alpha,
                                                                         target_modules=names, lora_dropout=0.0))
    start = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # base_model.model.<layer>.lora_A.default.weight <- <layer>.lora_A.weight
                layer, ab = name.removeprefix("base_model.model.").split(".lora_")
                p.copy_(start[f"{layer}.lora_{ab[0]}.weight"])
    return model


def run_rank(impl: str, model_name: str, r: int, steps: int) -> dict:
    import torch.distributed as dist
    from train.data import load_tokens, rank_batch

    torch.set_num_threads(1)
    family, stage, _, lora = IMPLS[impl]
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = load_tokens(None, SEQ)
    if family == "zerofunc":
        import zerofunc
        model = lora_model(model_name, r)[0] if lora else build_model(model_name)
        engine = zerofunc.initialize(model, {
            "train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {**OPT, "betas": list(OPT["betas"])}}})

        def train_step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss
    else:
        model = peft_model(model_name, r) if lora else build_model(model_name)
        if family == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            module = DDP(model)
        else:
            from torch.distributed.fsdp import fully_shard
            for block in (model.base_model.model if lora else model).h:
                fully_shard(block, reshard_after_forward=stage)
            module = fully_shard(model, reshard_after_forward=stage)
        train_step = torch_step(module, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT))
    times, losses = [], []
    for step in range(1, steps + 1):
        x, y, _ = rank_batch(tokens, step, MICRO_BATCH, world, rank, SEQ, SEED)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(float(train_step(x, y).detach()))
        times.append(time.perf_counter() - t0)
    final = torch.tensor([losses[-1]], dtype=torch.float64)
    dist.all_reduce(final)
    return {"times": times, "final_loss": float(final) / world, "peak_rss_bytes": _peak_rss_bytes()}


def run_impl(impl: str, model_name: str, r: int, steps: int, warmup: int) -> dict:
    from zerofunc.launch import RankError, spawn
    if IMPLS[impl][0] != "zerofunc" and IMPLS[impl][3] and importlib.util.find_spec("peft") is None:
        return {"status": "not installed"}
    try:
        out = spawn(run_rank, WORLD, impl, model_name, r, steps)
    except RankError as e:
        return {"status": "failed: " + str(e).strip().splitlines()[-1][:200]}
    return {"status": "ok", "step_time_s": statistics.median(out[0]["times"][warmup:]),
            "peak_rss_bytes": max(o["peak_rss_bytes"] for o in out), "final_loss": out[0]["final_loss"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--r", type=int, default=8, help="the LoRA rank (alpha 2R; default 8)")
    ap.add_argument("--steps", type=int, help="K: steps per run (default: peers.py's for the model)")
    ap.add_argument("--warmup", type=int, help="W: steps left out of the median")
    ap.add_argument("--repeat", type=int, default=3, help="runs per implementation, interleaved (default 3)")
    ap.add_argument("--impl", nargs="+", choices=list(IMPLS), help="run only these (default: all)")
    a = ap.parse_args(argv)
    _, _, k, w = MODELS[a.model]
    steps, warmup = a.steps if a.steps is not None else k, a.warmup if a.warmup is not None else w
    if not 0 <= warmup < steps or not 1 <= a.repeat <= 100 or a.r < 1:
        ap.error(f"need 0 <= --warmup < --steps, 1 <= --repeat <= 100 and --r >= 1, got {warmup}, {steps}, "
                 f"{a.repeat}, {a.r}")
    impls = a.impl or list(IMPLS)
    runs: dict[str, list[dict]] = {i: [] for i in impls}
    for n in range(a.repeat):
        for impl in impls:
            if runs[impl] and runs[impl][-1]["status"] != "ok":
                continue
            runs[impl].append(run := run_impl(impl, a.model, a.r, steps, warmup))
            print(f"# run {n + 1}/{a.repeat} {impl}: {run['status']}"
                  + (f" (step {run['step_time_s']:.3f} s)" if run["status"] == "ok" else ""), file=sys.stderr, flush=True)
    rows = {}
    for impl, got in runs.items():
        if got[-1]["status"] != "ok":
            rows[impl] = {"status": got[-1]["status"]}
            continue
        times = [g["step_time_s"] for g in got]
        rows[impl] = {"status": "ok", "step_time_s": statistics.median(times), "spread": (min(times), max(times)),
                      "rss": statistics.median(g["peak_rss_bytes"] for g in got), "loss": got[0]["final_loss"]}
    n_params = sum(p.numel() for p in build_model(a.model).parameters())
    print(f"model {a.model} ({n_params:,} parameters), LoRA r {a.r} alpha {2 * a.r} all-linear, {WORLD} gloo ranks, "
          f"seq {SEQ}, micro-batch {MICRO_BATCH}/rank, fp32, {steps} steps, median over steps {warmup + 1}-{steps}; "
          f"median of {a.repeat} interleaved runs")
    head = f"{'impl':<18}{'stage':>6}{'step s':>9}{'min-max s':>14}{'rss MiB':>9}{'loss@K':>11}{'x full':>8}{'x peft':>8}"
    print(head + "\n" + "-" * len(head))
    for impl, row in rows.items():
        family, _, stage, lora = IMPLS[impl]
        if row["status"] != "ok":
            print(f"{impl:<18}{stage:>6}  {row['status']}")
            continue
        full = rows.get("fsdp2-full" if family == "fsdp2" else f"zerofunc-full-{stage}", {}) if lora else {}
        peer = rows.get("peft-ddp" if stage == 0 else "peft-fsdp2", {}) if lora and family == "zerofunc" else {}
        ratio = lambda other: f"{row['step_time_s'] / other['step_time_s']:.2f}" if other.get("status") == "ok" else "-"
        lo, hi = row["spread"]
        print(f"{impl:<18}{stage:>6}{row['step_time_s']:>9.3f}{f'{lo:.3f}-{hi:.3f}':>14}{_fmt_mib(row['rss']):>9}"
              f"{row['loss']:>11.6f}{ratio(full):>8}{ratio(peer):>8}")
    return 0 if all(r["status"] in ("ok", "not installed") for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
