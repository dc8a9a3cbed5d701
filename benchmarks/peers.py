"""zerofunc next to its peers: the same GPT, data, seed and 2 gloo ranks through each.

    python benchmarks/peers.py --model tiny|30m|120m [--steps K] [--warmup W] [--repeat R] [--impl NAME ...] [--json]
    python benchmarks/peers.py --device cuda ...   # one GPU: one NCCL rank each, the device's peak memory

Implementations (each in its own fresh 2-rank world, one thread per rank):
  zerofunc stages 0-3; DeepSpeed stages 0-3 ("gradient_clipping": 0.0, torch's AdamW,
  "memory_efficient_linear": false at stage 3); PyTorch DDP; DDP +
  ZeroRedundancyOptimizer; FSDP2 `fully_shard` with reshard_after_forward False and True.

Every implementation starts from the same weights (`GPT.init_param(name, shape, 0)`),
sees the same global batch at every step (`train.data.rank_batch`), and uses AdamW
lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, fp32, no dropout.

Each implementation runs R times (default 3), interleaved (every implementation once,
then again), so that a slow spell of the machine falls on all of them. Reported per
implementation: the median over the runs of each run's median step time over steps
W+1..K (a barrier before each step starts; the time runs to after the optimizer step,
taken on rank 0), with the runs' spread (min-max); the median over the runs of each
rank's peak resident memory (getrusage ru_maxrss); the loss of step K (forward of the
K-th step, averaged over the ranks; the same in every run); and the ratio of time and
memory to zerofunc at the matching stage. Last, zerofunc's own stage 3 / stage 0. Stage matching for peers without stages: DDP ~ 0,
ZeroRedundancyOptimizer ~ 1, FSDP2 reshard False ~ 2, reshard True ~ 3.

The peers are optional dependencies: one whose import fails is reported "not installed".

`--device cuda`: each implementation on one GPU, a world of one NCCL rank (NCCL puts no two ranks on one device),
the step timed from a synchronize to one after it, and memory the allocator's peak (`max_memory_allocated`) in
place of resident memory. With one rank no collective moves data: the rows compare each implementation's
compute and the host's work around it, which a step of a few thousand tokens waits on (docs/CUDA.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `train` lives at the repo root

import torch

from benchmarks.peer_steps import training  # noqa: E402

WORLD = 2
SEQ = 128
MICRO_BATCH = 4
SEED = 0
OPT = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

MODELS = {
    # name: (model_config base, overrides, default steps, default warm-up)
    "tiny": ("gpt2-tiny", dict(dropout=0.0), 20, 5),
    "30m": ("gpt2-small", dict(n_layer=6, n_embd=640, n_head=10, vocab_size=256, block_size=SEQ, dropout=0.0), 12, 3),
    "120m": ("gpt2-small", dict(vocab_size=256, block_size=SEQ, dropout=0.0), 8, 2),  # gpt2-small's shape, bytes
}

# impl name -> (family, stage, matching zerofunc stage)
IMPLS = {
    "zerofunc-0": ("zerofunc", 0, 0),
    "zerofunc-1": ("zerofunc", 1, 1),
    "zerofunc-2": ("zerofunc", 2, 2),
    "zerofunc-3": ("zerofunc", 3, 3),
    "zerofunc-whole-0": ("zerofunc-whole", 0, 0),  # --compile whole: the step compiled, collectives inside
    "zerofunc-whole-1": ("zerofunc-whole", 1, 1),
    "zerofunc-whole-2": ("zerofunc-whole", 2, 2),
    "zerofunc-whole-3": ("zerofunc-whole", 3, 3),
    "deepspeed-0": ("deepspeed", 0, 0),
    "deepspeed-1": ("deepspeed", 1, 1),
    "deepspeed-2": ("deepspeed", 2, 2),
    "deepspeed-3": ("deepspeed", 3, 3),
    "ddp": ("ddp", None, 0),
    "zero-redundancy-opt": ("zro", None, 1),
    "fsdp2-reshard-false": ("fsdp2", False, 2),
    "fsdp2-reshard-true": ("fsdp2", True, 3),
}
REQUIRES = {"deepspeed": "deepspeed"}  # family -> importable module it needs


def build_model(model_name: str):
    """The GPT on CPU with the weights init_param gives for seed SEED: the same for every impl."""
    from zerofunc.models import GPT, model_config
    base, overrides = MODELS[model_name][:2] if isinstance(model_name, str) else model_name  # or (base, overrides)
    model = GPT(model_config(base, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(model.init_param(name, tuple(p.shape), SEED))
    return model


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_rank(impl: str, model_name: str, steps: int, warmup: int, shard_group=None, probe=None,
             checkpointing: str = "none", device: str = "cpu") -> dict:
    """One rank of one implementation; runs inside zerofunc.launch.spawn. `shard_group`: hybrid sharding (zerofunc,
    FSDP2). `probe(family, engine or module, train_step, x, y)`: run on an extra step K+1, its result returned.
    `checkpointing`: zerofunc's activation checkpointing mode (zerofunc.recompute), zerofunc's rows only.
    `device`: cpu, or cuda (GPU 0)."""
    import torch.distributed as dist
    from train.data import load_tokens, rank_batch

    import warnings
    sys.stdout.flush()
    os.dup2(2, 1)  # peers print to stdout (DeepSpeed's op build, its logs): keep the parent's stdout for the table/JSON
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated collective names, from any impl
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    family, stage, _ = IMPLS[impl]
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = load_tokens(None, SEQ)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    model = build_model(model_name)
    n_params = sum(p.numel() for p in model.parameters())
    # what a probe inspects: zerofunc's or DeepSpeed's engine, else the module
    engine, train_step = training(family, stage, model, dev, MICRO_BATCH, OPT, shard_group, checkpointing)

    times, losses = [], []
    for step in range(1, steps + 1):
        x, y = (t.to(dev) for t in rank_batch(tokens, step, MICRO_BATCH, world, rank, SEQ, SEED)[:2])
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        loss = train_step(x, y)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    dist.barrier()
    final = torch.tensor([losses[-1]], dtype=torch.float64, device=dev)
    dist.all_reduce(final)
    out = {"rank": rank, "times": times, "final_loss": float(final) / world, "peak_rss_bytes": _peak_rss_bytes(),
           "n_params": n_params}
    if dev.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    if probe is not None:
        x, y = (t.to(dev) for t in rank_batch(tokens, steps + 1, MICRO_BATCH, world, rank, SEQ, SEED)[:2])
        out["probe"] = probe(family, engine, train_step, x, y)
    return out


def run_impl(impl: str, model_name: str, steps: int, warmup: int, world: int = WORLD, shard_group=None,
             probe=None, checkpointing: str = "none", device: str = "cpu") -> dict:
    """One run of one implementation in a fresh world of `world` ranks (see run_rank for the rest); on cuda,
    NCCL's."""
    from zerofunc.launch import RankError, spawn
    family, _, _ = IMPLS[impl]
    row = {"status": "ok"}
    need = REQUIRES.get(family)
    if need and importlib.util.find_spec(need) is None:
        return {"status": "not installed"}
    t0 = time.perf_counter()
    try:
        out = spawn(run_rank, world, impl, model_name, steps, warmup, shard_group, probe, checkpointing, device,
                    backend="nccl" if device == "cuda" else "gloo")
    except RankError as e:
        msg = str(e)
        status = ("not installed" if "ModuleNotFoundError" in msg or "ImportError" in msg
                  else "failed: " + msg.strip().splitlines()[-1][:200])
        return {"status": status, "error": msg}
    row["wall_s"] = time.perf_counter() - t0
    row["step_time_s"] = statistics.median(out[0]["times"][warmup:])
    row["peak_rss_bytes"] = [r["peak_rss_bytes"] for r in out]
    if "peak_device_bytes" in out[0]:
        row["peak_device_bytes"] = [r["peak_device_bytes"] for r in out]
    row["final_loss"] = out[0]["final_loss"]
    row["n_params"] = out[0]["n_params"]
    return row | ({"probe": [r["probe"] for r in out]} if probe is not None else {})


def summarize(impl: str, runs: list[dict]) -> dict:
    """An implementation's runs in one row: medians over the runs, and the spread of the step time."""
    family, stage, zstage = IMPLS[impl]
    row = {"impl": impl, "stage": stage if family in ("zerofunc", "deepspeed") else zstage, "runs": len(runs),
           "step_time_s": None, "peak_rss_bytes": None, "final_loss": None, "status": "ok"}
    bad = next((r for r in runs if r["status"] != "ok"), None)
    if bad is not None:
        return row | {k: bad[k] for k in ("status", "error") if k in bad}
    times = [r["step_time_s"] for r in runs]
    losses = {r["final_loss"] for r in runs}
    row.update(step_time_s=statistics.median(times), step_time_spread_s=(min(times), max(times)),
               step_times_s=times, n_params=runs[0]["n_params"], final_loss=runs[0]["final_loss"],
               **{key: [int(statistics.median(per_rank)) for per_rank in zip(*(r[key] for r in runs))]
                  for key in ("peak_rss_bytes", "peak_device_bytes") if key in runs[0]})
    if len(losses) > 1:
        row["status"] = f"failed: the loss differs between runs ({sorted(losses)})"
    return row


def _fmt_mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


def print_table(rows: list[dict], model_name: str, steps: int, warmup: int, device: str = "cpu") -> None:
    zf = {r["stage"]: r for r in rows if IMPLS[r["impl"]][0] == "zerofunc" and r["status"] == "ok"}  # the eager step
    n = next((r["n_params"] for r in rows if r.get("n_params")), None)
    runs = max(r["runs"] for r in rows)
    # memory: each rank's peak resident memory on a CPU; on a GPU, the allocator's peak
    key, label = ("peak_device_bytes", "gpu") if device == "cuda" else ("peak_rss_bytes", "rss")
    world = next((len(r[key]) for r in rows if r.get(key)), WORLD)
    ranks = f"{world} gloo ranks" if device == "cpu" else f"{world} NCCL rank{'s' * (world > 1)} on the GPU"
    print(f"model {model_name} ({n:,} parameters), {ranks}, seq {SEQ}, micro-batch {MICRO_BATCH}/rank, "
          f"fp32, {steps} steps, median over steps {warmup + 1}-{steps}; median of {runs} interleaved runs"
          if n else f"model {model_name}")
    head = (f"{'impl':<22}{'stage':>6}{'step s':>9}{'min-max s':>14}{'x zf':>7}"
            + "".join(f"{f'{label}{i} MiB':>10}" for i in range(world))
            + f"{f'{label} x zf':>9}{'loss@K':>12}{'dloss rel':>11}  status")
    print(head)
    print("-" * len(head))
    for r in rows:
        ref = zf.get(r["stage"])
        if r["status"] != "ok":
            print(f"{r['impl']:<22}{r['stage']:>6}{'-':>9}{'-':>14}{'-':>7}" + f"{'-':>10}" * world
                  + f"{'-':>9}{'-':>12}{'-':>11}  {r['status']}")
            continue
        tr = f"{r['step_time_s'] / ref['step_time_s']:.2f}" if ref else "-"
        mr = f"{max(r[key]) / max(ref[key]):.2f}" if ref else "-"
        dl = f"{abs(r['final_loss'] - ref['final_loss']) / abs(ref['final_loss']):.1e}" if ref else "-"
        lo, hi = r["step_time_spread_s"]
        print(f"{r['impl']:<22}{r['stage']:>6}{r['step_time_s']:>9.3f}{f'{lo:.3f}-{hi:.3f}':>14}{tr:>7}"
              + "".join(f"{_fmt_mib(b):>10}" for b in r[key])
              + f"{mr:>9}{r['final_loss']:>12.6f}{dl:>11}  ok")
    if 0 in zf and 3 in zf:
        print(f"zerofunc stage 3 / stage 0 step time: {zf[3]['step_time_s'] / zf[0]['step_time_s']:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--steps", type=int, help="K: steps per implementation (the loss is reported after K)")
    ap.add_argument("--warmup", type=int, help="W: steps left out of the median")
    ap.add_argument("--repeat", type=int, default=3, help="R: runs per implementation, interleaved (default 3)")
    ap.add_argument("--impl", nargs="+", choices=list(IMPLS), help="run only these (default: all)")
    ap.add_argument("--json", action="store_true", help="also print the rows as a JSON list")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each implementation on one GPU, one NCCL rank (default: 2 gloo ranks on the CPU)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is available")
    _, _, k, w = MODELS[args.model]
    steps = args.steps if args.steps is not None else k
    warmup = args.warmup if args.warmup is not None else w
    if not 0 <= warmup < steps:
        ap.error(f"need 0 <= --warmup < --steps, got {warmup} and {steps}")
    if not 1 <= args.repeat <= 100:
        ap.error(f"need 1 <= --repeat <= 100, got {args.repeat}")
    impls = args.impl or list(IMPLS)
    # a peer's ratios need zerofunc's eager rows: then every row, in IMPLS' order; zerofunc's rows alone run as
    # asked, so that a stage's eager and compiled runs can follow each other
    if any(IMPLS[i][0] not in ("zerofunc", "zerofunc-whole") for i in impls):
        impls = [i for i in IMPLS if i in impls or IMPLS[i][0] == "zerofunc"]
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for r in range(args.repeat):
        for impl in impls:
            if runs[impl] and runs[impl][-1]["status"] != "ok":
                continue  # not installed, or failed: once is enough
            run = run_impl(impl, args.model, steps, warmup, world=WORLD if args.device == "cpu" else 1,
                           device=args.device)
            print(f"# run {r + 1}/{args.repeat} {impl}: {run['status']}"
                  + (f" ({run['wall_s']:.1f} s, step {run['step_time_s']:.3f} s)" if "wall_s" in run else ""),
                  file=sys.stderr, flush=True)
            runs[impl].append(run)
    rows = [summarize(impl, runs[impl]) for impl in impls]
    print_table(rows, args.model, steps, warmup, args.device)
    for r in rows:
        if r["status"] != "ok" and "error" in r:
            print(f"\n{r['impl']} {r['status']}", file=sys.stderr)
    if args.json:
        keep = ("impl", "stage", "step_time_s", "step_times_s", "peak_rss_bytes", "peak_device_bytes", "final_loss")
        print(json.dumps([{k: r[k] for k in keep if k in r} | ({"status": r["status"]} if r["status"] != "ok" else {})
                          for r in rows], indent=1))
    return 0 if all(r["status"] in ("ok", "not installed") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
