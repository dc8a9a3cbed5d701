"""The planner's model-state figures beside DeepSpeed's own estimators, for the same models and rank counts.

Usage: python benchmarks/deepspeed_estimates.py [--models llama3-8b llama3-70b] [--ranks 8 64 512]

DeepSpeed's formulas, as its source states them (no offload; deepspeed/runtime/zero/
stage_1_and_2.py and stage3.py, `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs`), restated here so DeepSpeed need not be installed:
    ZeRO-2: 2 P + 18 P / N        (16-bit params; 16-bit and fp32 grads, fp32 params, m, v sharded)
    ZeRO-3: 4 L + 18 P / N        (L: the parameters of the largest single module, gathered whole)
P counts a shared tensor once, as DeepSpeed's `model_to_params` does. zerofunc's figures
come from simulating one bf16 training step (`simulate`), at micro-batch 1 and 16 tokens,
since model states do not depend on the batch. Printed in GiB per rank.
"""
from __future__ import annotations

import argparse

import torch

from zerofunc.models import build_model, model_config
from zerofunc.plan import Plan, simulate

GiB = 2**30


def deepspeed_zero2(p: int, n: int) -> float:
    return 2 * p + int(18 * p / n)


def deepspeed_zero3(p: int, largest_layer: int, n: int) -> float:
    return 4 * largest_layer + int(18 * p / n)


def sizes(name: str) -> tuple[int, int]:
    """(P, the largest module's own parameter count), as DeepSpeed's model_to_params counts them."""
    with torch.device("meta"):
        model = build_model(model_config(name))
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 64, 512])
    a = ap.parse_args()
    print("GiB per rank; zerofunc: params + grads + optimizer (model states), and stage 3's gathered units")
    print(f"{'model':12s} {'N':>5s} | {'DS ZeRO-2':>10s} {'zf stage 2':>10s} | {'DS ZeRO-3':>10s} "
          f"{'zf stage 3':>10s} {'zf gathered':>11s}")
    for name in a.models:
        p, largest = sizes(name)
        for n in a.ranks:
            zf = {}
            for stage in (2, 3):
                sim = simulate(Plan(world_size=n, stage=stage, model=name, seq=16), timing=False)
                zf[stage] = (sim.memory.model_states, sim.memory.max_by_category["buffers"])
            print(f"{name:12s} {n:5d} | {deepspeed_zero2(p, n) / GiB:10.2f} {zf[2][0] / GiB:10.2f} | "
                  f"{deepspeed_zero3(p, largest, n) / GiB:10.2f} {zf[3][0] / GiB:10.2f} {zf[3][1] / GiB:11.2f}")


if __name__ == "__main__":
    main()
