"""Hybrid sharding next to PyTorch FSDP2's HSDP: the same GPT, data and seed on 4 gloo ranks, shard groups of 2.

    python benchmarks/hsdp_peers.py [--model tiny4|tiny] [--steps K] [--warmup W] [--repeat R] [--impl NAME ...] [--json]

Implementations (each in its own fresh 4-rank world, one thread per rank), run by benchmarks/peers.py's
functions with the same weights, data (`train.data.rank_batch` over 4 ranks) and AdamW:
  zerofunc stages 1-3 with "shard_group_size": 2 (2 replicas of 2 consecutive ranks: ranks {0,1} and {2,3}
  shard; {0,2} and {1,3} all-reduce their gradient shard once per step); FSDP2 `fully_shard` on every block
  then the root, on a (2, 2) device mesh ("replicate", "shard"), reshard_after_forward False (~ stage 2)
  and True (~ stage 3).

Reported as peers.py does: median step time over steps W+1..K (median of R interleaved runs, with their
spread), each rank's peak RSS, the loss of step K and its difference to zerofunc at the matching stage.
Then the collectives of one step, counted on an extra step K+1 of the last run (after the loss and the
times are taken): by op and group from zerofunc's ledger (`engine.comm.ledger`, the ops actually issued;
the token count's all-reduce, tagged "tokens", would be listed apart: this loop, as peers.py's, calls
engine(x, y) and issues none), and for FSDP2 from wrappers around the torch.distributed calls it makes
(group named by its ranks). Both are checked against the c10d ops the step dispatches (counts by op only; torch's
CommDebugMode counts the same, but its module tracker's backward hooks stop zerofunc's step, 2026-11-28).

The default model "tiny4" is gpt2-tiny with 4 blocks (gpt2-tiny itself has 2: model "tiny").
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, next to this file

import peers  # noqa: E402  (puts the repo root on sys.path too)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

WORLD, SHARD = 4, 2
MODELS = {  # name: ((model_config base, overrides), default steps, default warm-up)
    "tiny4": (("gpt2-tiny", dict(n_layer=4, dropout=0.0)), 20, 5),
    "tiny": (("gpt2-tiny", dict(dropout=0.0)), 20, 5),
}
IMPLS = ["zerofunc-1", "zerofunc-2", "zerofunc-3", "fsdp2-reshard-false", "fsdp2-reshard-true"]
DIST_FNS = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
            "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "broadcast")
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def op_name(name: str) -> str:
    """A collective's name as the ledger spells it: c10d._allgather_base_ and dist.all_gather_single are
    both all_gather."""
    flat = str(name).split(".")[-1].replace("_", "").lower()
    for op in OPS:
        if flat.startswith(op.replace("_", "")) or flat.startswith("base" + op.replace("_", "")):
            return op
    return str(name)


def group_name(ranks: list[int], world: int) -> str:
    if len(ranks) == world:
        return "world"
    consecutive = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    return "shard" if consecutive and len(ranks) == SHARD else "replicas" if not consecutive else f"ranks{ranks}"


class _DispatchedCollectives(TorchDispatchMode):
    """The c10d ops dispatched, by op (as CommDebugMode counts them, without its module tracker: that registers
    backward hooks on every module, whose nodes the tape of zerofunc's step refuses to join across blocks)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.counts[op_name(func.__name__.split(".")[0])] += 1
        return func(*args, **(kwargs or {}))


def count_collectives(family: str, engine, train_step, x, y) -> dict:
    """The collectives of one training step on this rank (a probe for peers.run_rank)."""
    import torch.distributed as dist
    world, calls = dist.get_world_size(), collections.Counter()
    saved = {name: getattr(dist, name) for name in DIST_FNS if hasattr(dist, name)}

    def wrap(name, fn):
        def call(*args, group=None, **kwargs):
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
            calls[f"{op_name(name)}@{group_name(ranks, world)}"] += 1
            return fn(*args, group=group, **kwargs)
        return call
    start = len(engine.comm.ledger) if family == "zerofunc" else 0
    if family != "zerofunc":  # zerofunc bound its all-gather at import; its ledger is the record there
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
    try:
        with _DispatchedCollectives() as mode:
            train_step(x, y)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    out = {"debug_mode": dict(mode.counts)}
    if family == "zerofunc":
        entries = engine.comm.ledger.entries[start:]
        out["by_group"] = dict(collections.Counter(f"{e.op}@{e.group}" for e in entries if e.tag != "tokens"))
        out["by_tag"] = dict(collections.Counter(f"{e.op}@{e.group}:{e.tag}{' (async)' if e.overlapped else ''}"
                                                 for e in entries))
        out["tokens"] = sum(e.tag == "tokens" for e in entries)
    else:
        out["by_group"] = dict(calls)
    return out


def summarize(impl: str, runs: list[dict]) -> dict:
    row = peers.summarize(impl, runs)
    if row["status"] == "ok":
        probes = runs[-1]["probe"]
        row["counts"] = probes[0]
        row["counts_differ_by_rank"] = any(p != probes[0] for p in probes[1:])
    return row


def print_tables(rows: list[dict], model_name: str, steps: int, warmup: int) -> None:
    zf = {r["stage"]: r for r in rows if r["impl"].startswith("zerofunc-") and r["status"] == "ok"}
    n = next((r["n_params"] for r in rows if r.get("n_params")), None)
    print(f"model {model_name} ({n or 0:,} parameters), {WORLD} gloo ranks, shard groups of {SHARD} "
          f"({WORLD // SHARD} replicas), seq {peers.SEQ}, micro-batch {peers.MICRO_BATCH}/rank, fp32, {steps} steps, "
          f"median over steps {warmup + 1}-{steps}; median of {max(r['runs'] for r in rows)} interleaved runs")
    head = (f"{'impl':<21}{'stage':>6}{'step s':>8}{'min-max s':>13}{'x zf':>6}"
            + "".join(f"{f'rss{i} MiB':>9}" for i in range(WORLD)) + f"{'loss@K':>12}{'dloss rel':>10}  status")
    print(head)
    print("-" * len(head))
    for r in rows:
        ref = zf.get(r["stage"])
        if r["status"] != "ok":
            print(f"{r['impl']:<21}{r['stage']:>6}  {r['status']}")
            continue
        tr = f"{r['step_time_s'] / ref['step_time_s']:.2f}" if ref else "-"
        dl = f"{abs(r['final_loss'] - ref['final_loss']) / abs(ref['final_loss']):.1e}" if ref else "-"
        lo, hi = r["step_time_spread_s"]
        print(f"{r['impl']:<21}{r['stage']:>6}{r['step_time_s']:>8.3f}{f'{lo:.3f}-{hi:.3f}':>13}{tr:>6}"
              + "".join(f"{b / 2**20:>9.0f}" for b in r["peak_rss_bytes"])
              + f"{r['final_loss']:>12.7f}{dl:>10}  ok")
    losses = [r["final_loss"] for r in rows if r["status"] == "ok"]
    if len(losses) > 1:
        print(f"loss@K over all rows: {min(losses):.7f} to {max(losses):.7f}, "
              f"spread {(max(losses) - min(losses)) / statistics.mean(losses):.1e} relative")
    ok = [r for r in rows if r["status"] == "ok"]
    cols = sorted({key for r in ok for key in r["counts"]["by_group"]}, key=lambda k: (OPS.index(k.split("@")[0])
                  if k.split("@")[0] in OPS else len(OPS), k))
    print(f"\ncollectives of one step (step {steps + 1} of the last run, rank 0), op@group: from the ledger (zerofunc, "
          f"ops as issued) or the torch.distributed calls (FSDP2); the c10d ops dispatched, by op (ag rs ar bc)")
    head = f"{'impl':<21}" + "".join(f"{c:>{max(len(c), 4) + 2}}" for c in cols) + f"{'dispatched':>20}"
    print(head)
    print("-" * len(head))
    for r in ok:
        c, d = r["counts"], r["counts"]["debug_mode"]
        print(f"{r['impl']:<21}" + "".join(f"{c['by_group'].get(k, 0):>{max(len(k), 4) + 2}}" for k in cols)
              + f"{' '.join(str(d.get(op, 0)) for op in OPS):>20}"
              + ("  (other) " + str({k: v for k, v in d.items() if k not in OPS}) if set(d) - set(OPS) else "")
              + ("  (ranks differ)" if r["counts_differ_by_rank"] else ""))
    for r in ok:
        if "by_tag" in r["counts"]:
            print(f"{r['impl']} by tag: " + ", ".join(f"{k} {key}" for key, k in sorted(r["counts"]["by_tag"].items()))
                  + f"; token-count all-reduces: {r['counts']['tokens']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny4")
    ap.add_argument("--steps", type=int, help="K: steps per implementation (the loss is reported after K)")
    ap.add_argument("--warmup", type=int, help="W: steps left out of the median")
    ap.add_argument("--repeat", type=int, default=3, help="R: runs per implementation, interleaved (default 3)")
    ap.add_argument("--impl", nargs="+", choices=IMPLS, help="run only these (default: all)")
    ap.add_argument("--json", action="store_true", help="also print the rows as a JSON list")
    args = ap.parse_args(argv)
    spec, k, w = MODELS[args.model]
    steps = args.steps if args.steps is not None else k
    warmup = args.warmup if args.warmup is not None else w
    if not 0 <= warmup < steps:
        ap.error(f"need 0 <= --warmup < --steps, got {warmup} and {steps}")
    if not 1 <= args.repeat <= 100:
        ap.error(f"need 1 <= --repeat <= 100, got {args.repeat}")
    impls = [i for i in IMPLS if i in (args.impl or IMPLS) or i.startswith("zerofunc-")]  # ratios need zerofunc
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    load_before = os.getloadavg()[0]
    for r in range(args.repeat):
        for impl in impls:
            if runs[impl] and runs[impl][-1]["status"] != "ok":
                continue
            run = peers.run_impl(impl, spec, steps, warmup, world=WORLD, shard_group=SHARD,
                                 probe=count_collectives if r == args.repeat - 1 else None)
            print(f"# run {r + 1}/{args.repeat} {impl}: {run['status']}"
                  + (f" ({run['wall_s']:.1f} s, step {run['step_time_s']:.3f} s)" if "wall_s" in run else ""),
                  file=sys.stderr, flush=True)
            runs[impl].append(run)
    rows = [summarize(impl, runs[impl]) for impl in impls]
    print_tables(rows, args.model, steps, warmup)
    print(f"1-minute load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    for r in rows:
        if r["status"] != "ok" and "error" in r:
            print(f"\n{r['impl']} {r['status']}\n{r['error']}", file=sys.stderr)
    if args.json:
        keep = ("impl", "stage", "step_time_s", "step_times_s", "peak_rss_bytes", "final_loss", "counts")
        print(json.dumps([{k: r[k] for k in keep if k in r} | ({"status": r["status"]} if r["status"] != "ok" else {})
                          for r in rows], indent=1))
    return 0 if all(r["status"] in ("ok", "not installed") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
