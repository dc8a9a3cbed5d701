"""Pretrained weights in, how fast: zerofunc's sharded load of a Hugging Face model directory against
transformers' `from_pretrained` of the same directory, and against the disk (issue 24).

    python benchmarks/load_speed.py [--family llama|qwen2] [--layers 24 --hidden 1024 --intermediate 2816
        --heads 16 --kv-heads 8 --vocab 32000] [--dtype bf16|fp32] [--ranks 1 2] [--repeat 3] [--dir DIR]
        [--profile] [--json]

A directory of random weights is written with `save_pretrained(max_shard_size=...)` (several
safetensors shards and their index, as a Hub download looks), in a temporary directory or in --dir
(reused if it already holds a config.json). The files are read once first, so every load below reads
from the page cache. Measured, each in a fresh process (world), interleaved over --repeat runs:

- zerofunc: every rank of R gloo ranks, after a barrier, builds zerofunc's own model on the meta
  device from config.json, opens the files (`pretrained.weights`, headers only) and builds a stage-3
  engine with `zerofunc.initialize(..., init=source)`; the time is the slowest rank's. Stage 0 on one
  rank (the whole model) for comparison. The engine holds fp32 masters and AdamW's m and v as well as
  the working weights, so its memory is model states, not weights alone ("states" column).
- transformers: `AutoModelForCausalLM.from_pretrained(dir, dtype=...)` in one process, what every rank
  would do without zerofunc. transformers 5 builds the model on the meta device whatever
  `low_cpu_mem_usage` says (the argument is dropped), and reads with a pool of min(4, cores) threads;
  a weight whose dtype is the file's stays a view of the file's private memory map, not yet read. So
  a second row adds a first read of every weight (`p.sum()`), which is what puts it in memory.
- for reference, `torch.zeros` of zerofunc's 1-rank model states' bytes in a fresh process like the
  others: what first touching that much fresh memory costs here, with no file read.
- the disk: the files read sequentially with O_DIRECT (16 MiB reads; posix_fadvise DONTNEED first if
  O_DIRECT is refused), so what a cold load would wait for; and plain read() from the page cache.

GB/s is the files' bytes (1e9) over the time, for every row, so rows compare directly; "x tf" and
"x tf+read" are times over the two transformers rows'. "RSS+" is the largest rank's ru_maxrss after
the load minus before it (file pages read through the memory map count too): the point of sharding
is that a rank holds only its shard. Ranks get cores // R torch threads each; the others all the cores.
`--profile` runs cProfile on rank 0 of the first stage-3 load and prints where the time went.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import json
import mmap
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CORES = os.cpu_count() or 1


def build_dir(out: Path, family: str, dims: dict, dtype: torch.dtype, shard: str) -> None:
    """Random weights saved as Hugging Face would: built on meta, filled in place, saved in shards."""
    import transformers as tf
    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[family]
    cfg = config_cls(num_hidden_layers=dims["layers"], hidden_size=dims["hidden"],
                     intermediate_size=dims["intermediate"], num_attention_heads=dims["heads"],
                     num_key_value_heads=dims["kv_heads"], vocab_size=dims["vocab"], max_position_embeddings=2048,
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = model_cls(cfg)
    model = model.to_empty(device="cpu").to(dtype)  # from_config's init of 350M parameters takes far longer
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(out, max_shard_size=shard)


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def read_all(files: list[Path]) -> float:
    """Read the files with plain read(); the seconds it took (from the page cache once they are in it)."""
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
    return time.perf_counter() - t0


def disk_read(files: list[Path]) -> tuple[float, str]:
    """Seconds to read the files from the disk itself, sequentially, and how the page cache was avoided."""
    buf, how, total = mmap.mmap(-1, 16 << 20), "O_DIRECT", 0.0  # O_DIRECT wants an aligned buffer: mmap's is
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd, how = os.open(f, os.O_RDONLY), "fadvise(DONTNEED), then read"
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]):
            pass
        total += time.perf_counter() - t0
        os.close(fd)
    return total, how


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def zerofunc_rank(path: Path, stage: int, dtype: str, profile: bool) -> dict:
    """One rank: config.json -> meta model -> sharded engine filled from the files."""
    import torch.distributed as dist
    import zerofunc
    from zerofunc import pretrained
    from zerofunc.models import build_model, model_config

    import torch._dynamo  # noqa: F401 -- start-up: the first meta-device init op imports it (~3.5 s here)
    torch.set_num_threads(max(1, CORES // dist.get_world_size()))
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1,
              "bf16": {"enabled": dtype == "bf16"}}
    prof = cProfile.Profile() if profile and dist.get_rank() == 0 else None
    base = _maxrss()
    dist.barrier()
    t0 = time.perf_counter()
    with prof or contextlib.nullcontext():
        with torch.device("meta"):
            model = build_model(model_config(str(path / "config.json")))
        engine = zerofunc.initialize(model, config, init=pretrained.weights(path, model))
    t1 = time.perf_counter()
    if prof:
        print(f"# cProfile, rank 0 of {dist.get_world_size()}, stage {stage}, by own time:", file=sys.stderr)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for u in engine.units for t in (u.params, u.master, u.m, u.v)}
    return {"seconds": t1 - t0, "rss": _maxrss() - base, "states": sum(storages.values())}


def transformers_rank(path: Path, stage: int, dtype: str, profile: bool) -> dict:
    """What a rank does without zerofunc: load the whole model; then read every weight once, since
    from_pretrained leaves weights of the files' dtype as views of the memory-mapped files, unread."""
    from transformers import AutoModelForCausalLM
    for family in ("llama", "qwen2"):  # importing is not loading (and transformers has imported torch._dynamo)
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    torch.set_num_threads(CORES)
    base = _maxrss()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    t1 = time.perf_counter()
    rss = _maxrss() - base
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    t2 = time.perf_counter()
    states = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"seconds": t1 - t0, "rss": rss, "states": states, "read_s": t2 - t0, "read_rss": _maxrss() - base}


def memory_rank(path: Path, stage: int, dtype: str, profile: bool) -> dict:
    """What zerofunc's 1-rank load costs without the files: fresh zeroed memory the size of its model states
    (working weights, an fp32 master unless they are it, AdamW's m and v), in one allocation."""
    from zerofunc.models import build_model, model_config
    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(model_config(str(path / "config.json"))).parameters())
    torch.set_num_threads(CORES)
    base = _maxrss()
    t0 = time.perf_counter()
    states = torch.zeros(n * (14 if dtype == "bf16" else 12), dtype=torch.uint8)
    return {"seconds": time.perf_counter() - t0, "rss": _maxrss() - base, "states": states.numel()}


def run(method: tuple, path: Path, dtype: str, profile: bool) -> dict:
    """One load in a fresh world of the method's ranks; the slowest rank's time, the largest rank's RSS."""
    from zerofunc.launch import spawn
    name, stage, ranks = method
    fn = {"zerofunc": zerofunc_rank, "transformers": transformers_rank, "memory": memory_rank}[name]
    read_all(weight_files(path))  # back into the page cache, should anything have pushed it out
    out = spawn(fn, ranks, path, stage, dtype, profile, timeout=600)
    slowest = max(out, key=lambda r: r["seconds"])
    return slowest | {"rss": max(r["rss"] for r in out), "states": max(r["states"] for r in out)}


def row(method: str, ranks: int, runs: list[dict], time_key: str, rss_key: str) -> dict:
    """Medians over the runs; the spread of the time."""
    times = [r[time_key] for r in runs]
    return {"method": method, "ranks": ranks, "seconds": statistics.median(times), "spread": (min(times), max(times)),
            "rss": statistics.median(r[rss_key] for r in runs)}


def label(method: tuple) -> str:
    name, stage, ranks = method
    return {"zerofunc": f"zerofunc stage {stage}", "transformers": "transformers from_pretrained",
            "memory": "torch.zeros of the 1-rank states"}[name]


def print_table(rows: list[dict], size: int) -> None:
    tf_s, tf_read_s = (r["seconds"] for r in rows if r["method"].startswith(("transformers", "  + a first")))
    head = (f"{'method':<40}{'ranks':>6}{'s':>8}{'min-max s':>14}{'GB/s':>7}{'x tf':>7}{'x tf+read':>10}"
            f"{'RSS+ MiB':>10}{'states MiB':>12}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        spread = f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}" if "spread" in r else "-"
        rss, states = (f"{r[k] / 2**20:.0f}" if k in r else "-" for k in ("rss", "states"))
        print(f"{r['method']:<40}{r['ranks'] or '-':>6}{r['seconds']:>8.2f}{spread:>14}"
              f"{size / 1e9 / r['seconds']:>7.2f}{r['seconds'] / tf_s:>7.2f}{r['seconds'] / tf_read_s:>10.2f}{rss:>10}{states:>12}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=("llama", "qwen2"), default="llama")
    for name, default in (("layers", 24), ("hidden", 1024), ("intermediate", 2816), ("heads", 16),
                          ("kv-heads", 8), ("vocab", 32000)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="of the files and of the loaded model")
    ap.add_argument("--shard", default="200MB", help="save_pretrained's max_shard_size")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="zerofunc stage-3 world sizes")
    ap.add_argument("--repeat", type=int, default=3, help="loads per method, interleaved; medians reported")
    ap.add_argument("--dir", type=Path, help="build the model directory here, or reuse it (kept afterwards)")
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0 of the first stage-3 load")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args(argv)
    if args.repeat < 1 or any(r < 1 for r in args.ranks):
        ap.error("--repeat and --ranks must be >= 1")
    dims = {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")}
    path = args.dir or Path(tempfile.mkdtemp(prefix="load_speed_"))
    try:
        if not (path / "config.json").is_file():
            t0 = time.perf_counter()
            build_dir(path, args.family, dims, DTYPES[args.dtype], args.shard)
            print(f"# built {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        files = weight_files(path)
        size = sum(f.stat().st_size for f in files)
        disk = [disk_read(files) for _ in range(3)]
        disk_s, how = statistics.median(d[0] for d in disk), disk[0][1]
        read_all(files)
        cache_s = statistics.median(read_all(files) for _ in range(3))

        methods = [("zerofunc", 3, r) for r in args.ranks] + [("zerofunc", 0, 1), ("transformers", None, 1)]
        methods.append(("memory", None, 1))
        runs: dict[tuple, list[dict]] = {m: [] for m in methods}
        for i in range(args.repeat):
            for m in methods:
                prof = args.profile and i == 0 and m == methods[0]
                runs[m].append(run(m, path, args.dtype, prof))
                print(f"# run {i + 1}/{args.repeat} {label(m)}, {m[2]} rank(s): {runs[m][-1]['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
        rows = []
        for m in methods:
            rows.append(row(label(m), m[2], runs[m], "seconds", "rss") | {"states": runs[m][0]["states"]})
            if m[0] == "transformers":
                rows.append(row("  + a first read of every weight", 1, runs[m], "read_s", "read_rss"))
        rows += [{"method": f"disk, sequential ({how})", "ranks": None, "seconds": disk_s},
                 {"method": "page cache, read()", "ranks": None, "seconds": cache_s}]

        print(f"{args.family}: {dims}, {args.dtype}, {size / 1e9:.3f} GB in {len(files)} files; {CORES} cores; "
              f"median of {args.repeat} loads from the page cache; load average {os.getloadavg()[0]:.2f}")
        print_table(rows, size)
        if args.json:
            print(json.dumps([r | {"bytes": size} for r in rows], indent=1))
    finally:
        if args.dir is None:
            shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
