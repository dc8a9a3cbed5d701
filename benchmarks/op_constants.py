"""The per-op-class constants of issue 33 (item 6), measured on the device at hand: what a planner that costs
compute per op class needs, beside the published figures of sim/profiles.json.

    python benchmarks/op_constants.py [--device cuda|cpu] [--model llama3-8b] [--tokens T] [--json-out FILE]
                                      [--profiles-out FILE]

- GEMM: bf16 matmuls of the shapes one block of `--model` runs at T tokens (each projection's forward
  x @ W^T, its input gradient and its weight gradient), and square references (2048^3, 4096^3, 8192^3,
  and 4096 x 4096 x 256, XLA's table's small-K point); TFLOP/s and the fraction of the profile's peak.
- Attention: causal scaled-dot-product attention of the model's heads at T tokens, forward, and forward
  and backward (torch picks the kernel: flash on an A100/H100), at its executed FLOPs (half of the
  unmasked count: torch's flop counter charges causal attention as full) and the fraction of peak.
- Memory-bound: a device-to-device copy of 1 GiB (read and written), as a fraction of the profile's HBM
  bandwidth.
- The kernel floor: the device time of a 1-element add, one of 2,000 launched back to back.

`--profiles-out FILE` records them as the device's profile's measured `kernels` in a user profiles file
(sim.hardware.record_measured; plan with it: `--profiles FILE`, or `python benchmarks/published.py --profiles
FILE`): the GEMM ceiling that, through the planner's tile and wave model, gives the median of the block's
measured GEMMs; attention forward and backward as measured; the copy's fraction of HBM for transfers of
100 MB and more (the smaller sizes' published fractions scaled by it); the kernel floor as measured.

Medians of CUDA-event timings after warm-up; on `--device cpu` the same code with wall-clock timings and
small shapes, to check the script, not the CPU. Each GPU's peak comes from the profile naming it
(sim/profiles.json's `device_names`); none found: fractions are left out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sim.hardware import profile_for_device, record_measured  # noqa: E402
from zerofunc.check.calibrate import cuda_median_s, wall_median_s  # noqa: E402
from zerofunc.models import model_config  # noqa: E402


def timed(fn, device: str, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn()` over `reps` runs: by CUDA events, or on a CPU by the wall clock."""
    return (cuda_median_s if device == "cuda" else wall_median_s)(fn, warmup, reps)


def gemm_shapes(cfg, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of a block's matmuls: forward y[M, N] = x[M, K] @ W^T, then dX and dW."""
    d, kv = cfg.n_embd, cfg.n_embd // cfg.n_head * cfg.n_kv_head
    ff = cfg.intermediate_size
    shapes = []
    for name, n, k in (("q", d, d), ("k/v", kv, d), ("o", d, d), ("gate/up", ff, d), ("down", d, ff)):
        shapes += [(f"{name} fwd", tokens, n, k), (f"{name} dX", tokens, k, n), (f"{name} dW", n, k, tokens)]
    return shapes + [("ref 2048^3", 2048, 2048, 2048), ("ref 4096^3", 4096, 4096, 4096),
                     ("ref 8192^3", 8192, 8192, 8192), ("ref 4096x4096x256", 4096, 4096, 256)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (default: 8192 on CUDA, 64 on CPU)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--profiles-out", default=None, help="record the measured kernels into this profiles file")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, and torch sees no GPU", file=sys.stderr)
        return 2
    dev, cpu = a.device, a.device == "cpu"
    tokens = a.tokens or (64 if cpu else 8192)
    cfg = model_config(a.model)
    dtype = torch.float32 if cpu else torch.bfloat16
    name = torch.cuda.get_device_name(0) if not cpu else "cpu"
    profile = None
    if not cpu:
        try:
            profile = profile_for_device(name)
        except ValueError:
            pass
    peak = profile.flops["bf16"] if profile else None
    frac = lambda rate: None if peak is None else rate / peak  # noqa: E731
    rows = {"device": name, "profile": profile.name if profile else None, "torch": torch.__version__,
            "model": a.model, "tokens": tokens, "gemm": [], "attention": {}, "copy": {}, "kernel_floor_s": None}
    scale = 16 if cpu else 1  # small shapes on a CPU: a check of the script
    for label, m, n, k in gemm_shapes(cfg, tokens):
        m, n, k = max(1, m // scale), max(1, n // scale), max(1, k // scale)
        x, w = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(n, k, device=dev, dtype=dtype)
        s = timed(lambda: x @ w.T, dev)
        rows["gemm"].append({"name": label, "m": m, "n": n, "k": k, "s": s, "tflops": 2 * m * n * k / s / 1e12,
                             "fraction_of_peak": frac(2 * m * n * k / s)})
    heads, hd = cfg.n_head, cfg.n_embd // cfg.n_head
    t = tokens // (scale if cpu else 1)
    q, k_, v = (torch.randn(1, heads, t, hd, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    executed = 4 * heads * t * t * hd / 2  # causal: half of QK^T and PV's 2 x 2 x T^2 x d per head
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True), dev, reps=10)
    both = timed(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True).sum().backward(), dev, reps=10)
    bwd = max(both - fwd, 1e-12)
    rows["attention"] = {"heads": heads, "head_dim": hd, "tokens": t, "forward_s": fwd, "backward_s": bwd,
                         "forward_fraction_of_peak": frac(executed / fwd),
                         "backward_fraction_of_peak": frac(2.5 * executed / bwd)}  # backward: 2.5x forward's FLOPs
    src = torch.empty((1 << 30) // (scale * scale), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), dev)
    rate = 2 * src.numel() / s
    rows["copy"] = {"bytes": src.numel(), "s": s, "bytes_per_s": rate,
                    "fraction_of_hbm": rate / profile.memory_bandwidth if profile else None}
    one = torch.zeros(1, device=dev)
    launches = 2000
    rows["kernel_floor_s"] = timed(lambda: [one.add_(1) for _ in range(launches)], dev, reps=5) / launches

    print(f"{name} ({rows['profile'] or 'no profile'}), torch {torch.__version__}, {a.model} at {tokens} tokens")
    print(f"{'gemm':<20}{'M':>7}{'N':>7}{'K':>7}{'TFLOP/s':>10}{'of peak':>9}")
    for g in rows["gemm"]:
        share = f"{g['fraction_of_peak']:.3f}" if g["fraction_of_peak"] is not None else "-"
        print(f"{g['name']:<20}{g['m']:>7}{g['n']:>7}{g['k']:>7}{g['tflops']:>10.1f}{share:>9}")
    att = rows["attention"]
    print(f"attention, causal, {heads} heads x {hd} at {t}: forward {att['forward_s'] * 1e3:.3f} ms "
          f"({att['forward_fraction_of_peak'] or 0:.3f} of peak), backward {att['backward_s'] * 1e3:.3f} ms "
          f"({att['backward_fraction_of_peak'] or 0:.3f})")
    print(f"copy: {rows['copy']['bytes_per_s'] / 1e9:.0f} GB/s ({rows['copy']['fraction_of_hbm'] or 0:.3f} of HBM); "
          f"kernel floor: {rows['kernel_floor_s'] * 1e6:.2f} us")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    if a.profiles_out:
        if profile is None or profile.kernels is None:
            print("error: --profiles-out needs a GPU whose profile prices ops by class", file=sys.stderr)
            return 2
        kernels = measured_kernels(rows, profile)
        path = record_measured(profile.name, {"kernels": kernels},
                               f"benchmarks/op_constants.py on {name}, torch {torch.__version__}, {a.model} at "
                               f"{tokens} tokens: GEMM ceiling from the block's GEMMs through the tile/wave model, "
                               f"flash attention forward/backward, a 1 GiB copy, 2,000 back-to-back launches",
                               Path(a.profiles_out))
        print(f"recorded {profile.name}'s measured kernels in {path}: {json.dumps(kernels)}")
    return 0


def measured_kernels(rows: dict, profile) -> dict:
    """The profile's `kernels` with what was measured: the ceiling that makes the planner's price of each of the
    block's GEMMs (ceiling x its wave efficiency) meet the median of their measured rates."""
    k = profile.kernels
    block = [g for g in rows["gemm"] if not g["name"].startswith("ref")]
    ceiling = statistics.median(g["fraction_of_peak"] / k.wave_efficiency(1, g["m"], g["n"]) for g in block)
    copy = rows["copy"]["fraction_of_hbm"]
    top = k.memory_efficiency[0][1]
    return {"gemm_ceiling": min(ceiling, 1.0),
            "attention_forward": min(rows["attention"]["forward_fraction_of_peak"], 1.0),
            "attention_backward": min(rows["attention"]["backward_fraction_of_peak"], 1.0),
            "memory_efficiency": [[size, min(1.0, e * copy / top)] for size, e in k.memory_efficiency],
            "floor_s": rows["kernel_floor_s"]}


if __name__ == "__main__":
    raise SystemExit(main())
