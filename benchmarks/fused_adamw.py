"""Fused AdamW that also writes the 16-bit copy, against torch's fused AdamW, on one flat fp32 shard.

An optimizer step over a shard is memory-bound: its time is the bytes it must move
divided by the bandwidth it achieves. So each variant is reported with the bytes it has
to move per element, counted explicitly (param read+write 8, grad read 4 or 2, m
read+write 8, v read+write 8, 16-bit copy written 2, read back 4 when it is a separate
copy), and the bandwidth that implies. torch's fused AdamW does not write a 16-bit copy,
which the next all-gather (stages 1-2) or forward (stages 0, 3) needs, so it is timed
both with a separate `.to(bfloat16)` copy (what zerofunc would have to do with it) and
without (its floor). The eager torch reference is listed for scale.

    python benchmarks/fused_adamw.py [--numel 67108864] [--grad-dtype fp32|bf16] [--iters 50]

Needs a CUDA GPU; elsewhere it says so and exits with 2.
"""
from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=2**26, help="elements in the fp32 shard (default 2**26)")
    p.add_argument("--grad-dtype", choices=sorted(DTYPES), default="fp32",
                   help="gradient dtype for zerofunc's kernel (torch's fused AdamW needs fp32)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from zerofunc.check.calibrate import cuda_median_s
    from zerofunc.fused import adamw_reference_, adamw_triton_
    from zerofunc.optim import AdamWConfig

    n, dev = a.numel, torch.device("cuda")
    cfg = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator(device=dev).manual_seed(0)
    grad32 = torch.randn(n, device=dev, generator=gen)
    grad = grad32.to(DTYPES[a.grad_dtype])
    g_bytes = grad.element_size()

    def ours(impl, with_out: bool):
        param, m, v = torch.randn(n, device=dev, generator=gen), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        out = torch.empty(n, device=dev, dtype=torch.bfloat16) if with_out else None
        step = [0]

        def run():
            step[0] += 1
            impl(param, grad, m, v, step[0], cfg, grad_scale=0.5, out=out)
        return run

    def theirs(with_copy: bool):
        param = torch.nn.Parameter(torch.randn(n, device=dev, generator=gen))
        param.grad = grad32
        opt = torch.optim.AdamW([param], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, fused=True)
        out = torch.empty(n, device=dev, dtype=torch.bfloat16)

        def run():
            opt.step()
            if with_copy:
                out.copy_(param.detach())
        return run

    state = 8 + 8 + 8  # param, m, v: each read and written in fp32
    variants = [  # (name, bytes per element, a function that allocates one variant's buffers and returns its step)
        (f"zerofunc adamw_triton_, {a.grad_dtype} grad, + bf16 out", state + g_bytes + 2,
         lambda: ours(adamw_triton_, True)),
        (f"zerofunc adamw_triton_, {a.grad_dtype} grad, no out", state + g_bytes, lambda: ours(adamw_triton_, False)),
        ("torch AdamW(fused=True) + separate .to(bf16)", state + 4 + 4 + 2, lambda: theirs(True)),
        ("torch AdamW(fused=True), no copy", state + 4, lambda: theirs(False)),
        (f"zerofunc adamw_reference_ (eager), {a.grad_dtype} grad, + bf16 out", state + g_bytes + 2,
         lambda: ours(adamw_reference_, True)),
    ]
    print(f"{torch.cuda.get_device_name(dev)}: fp32 shard of {n:,} elements, median of {a.iters} steps")
    print(f"{'variant':<56} {'B/elem':>6} {'ms/step':>8} {'GB/s':>7}")
    for name, per_elem, make in variants:
        run = make()  # one variant's buffers at a time
        ms = cuda_median_s(run, a.warmup, a.iters) * 1e3
        print(f"{name:<56} {per_elem:>6} {ms:>8.3f} {per_elem * n / ms / 1e6:>7.0f}")
        del run
        torch.cuda.empty_cache()
    print("B/elem: bytes each variant must move per element; the eager reference moves more (its temporaries),"
          " so its GB/s counts only the necessary bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
