"""The fused kernels compiled ahead of time for sm_80 and sm_90 on a machine without a GPU.

tests/aot.py calls the wrappers the optimizer calls, on the shards zerofunc.layout makes,
under a stand-in driver; Triton compiles each specialization to PTX and a cubin with the
wheel's ptxas. What the interpreter cannot see is asserted here: everything compiles, no
register spills, resources within the target's limits, the numerics contract in the PTX,
and 128-bit loads for every shard. It runs in a subprocess per target (conftest.py sets
TRITON_INTERPRET=1 for this process), with an empty Triton cache, so every kernel really
compiles. docs/CUDA.md holds the figures.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.aot import GRADS, REGS_PER_BLOCK, TARGETS
from zerofunc.fused import BLOCK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("ptxas", "ptxas-blackwell", "cuobjdump")  # ptxas for sm_80, ptxas-blackwell for sm_90


def missing() -> str | None:
    """Why the kernels cannot be compiled for NVIDIA here, or None."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return "triton is not installed"
    bin_dir = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin")
    absent = [t for t in TOOLS if not os.access(os.path.join(bin_dir, t), os.X_OK)]
    if absent:
        return f"triton's NVIDIA backend lacks {', '.join(absent)} (in {bin_dir})"
    return None


pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """tests/aot.py's records, one subprocess per target, both at once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    started = time.monotonic()
    runs = []
    for cc in TARGETS:
        cache = tmp_path_factory.mktemp(f"triton-cache-sm{cc}")  # empty: every kernel compiles
        runs.append(subprocess.Popen([sys.executable, "-m", "tests.aot", "--json", "--cc", str(cc)], cwd=ROOT,
                                     env=env | {"TRITON_CACHE_DIR": str(cache)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True))
    results = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"tests/aot.py failed:\n{err[-4000:]}"
        results.append(json.loads(out))
    return dict(cpu_rank=results[0]["cpu_rank"], records=[r for res in results for r in res["records"]],
                seconds=time.monotonic() - started)


def label(r) -> str:
    lerp = "" if r["lerp_small"] is None else f", lerp {'small' if r['lerp_small'] else 'large'}"
    return f"sm_{r['cc']} {r['kernel']} {r['grad']} -> {r['out'] or '-'}{lerp} (e.g. {r['examples'][0]})"


def per_thread(r) -> int:
    """Elements each thread handles: the block over the threads of its warps."""
    return BLOCK // r["threads"]


def test_every_specialization_the_trainer_uses_compiles_once_per_target(compiled):
    """fp32, bf16 and fp16 gradients, with and without the output, both lerp formulas; unscaling fp16
    with and without the fp32 copy. Once: no shard the layout makes compiles to a second variant."""
    grads = [DTYPE[str(g)] for g in GRADS]
    want = sorted([(cc, "adamw", g, out, lerp) for cc in TARGETS for g in grads for out in (None, g)
                   for lerp in (True, False)] + [(cc, "unscale", "fp16", out, None) for cc in TARGETS
                                                 for out in (None, "fp32")], key=str)
    key = lambda r: (r["cc"], r["kernel"], r["grad"], r["out"], r["lerp_small"])  # noqa: E731
    got = sorted(map(key, compiled["records"]), key=str)
    twice = [f"{label(r)}: hinted {r['hinted']}, {r['calls']} calls, sizes {r['sizes'][:4]}"
             for r in compiled["records"] if got.count(key(r)) > 1]
    assert got == want, (f"not compiled: {sorted(set(want) - set(got), key=str)}\n"
                         "compiled more than once (some shards lost a hint):\n" + "\n".join(twice))
    assert all(r["calls"] > 0 for r in compiled["records"])
    assert {r["target"] for r in compiled["records"]} == {"sm_80", "sm_90a"}


def test_no_spills_and_resources_within_the_targets_limits(compiled):
    """cuobjdump's LOCAL (Triton's n_spills is LOCAL / 4) and STACK are 0; registers fit a thread and
    the block (the launcher's own check, on threads per block, ran too); shared memory fits the device."""
    bad = [f"{label(r)}: {r['regs']} registers x {r['threads']} threads (at most {r['max_threads']}), "
           f"local {r['local']} B, stack {r['stack']} B, shared {r['shared']} of {r['max_shared']} B"
           for r in compiled["records"]
           if r["local"] or r["stack"] or r["n_spills"] or not 0 < r["regs"] <= 255
           or r["regs"] * r["threads"] > REGS_PER_BLOCK or r["threads"] > r["max_threads"]
           or r["shared"] > r["max_shared"]]
    assert not bad, "\n".join(bad)


def test_the_numerics_contract_holds_in_the_ptx(compiled):
    """fp contraction off: the only FMAs are the kernel's explicit ones (AdamW's lerp and addcmul, two
    per element), and every other f32 add, sub and mul carries .rn, which ptxas may not contract.
    IEEE division and square root (div.rn, sqrt.rn), nothing .approx."""
    bad = []
    for r in compiled["records"]:
        k = per_thread(r)
        want = dict(fma=2 * k, div_rn=2 * k, sqrt_rn=k) if r["kernel"] == "adamw" else dict(fma=0, div_rn=0, sqrt_rn=0)
        want |= dict(fp_fusion=False, approx=0, contractible=0)
        if any(r[key] != v for key, v in want.items()):
            bad.append(f"{label(r)}: " + ", ".join(f"{key} {r[key]}" + ("" if r[key] == v else f" (want {v})")
                                                   for key, v in want.items()))
    assert not bad, "\n".join(bad)


def test_every_shard_of_the_layout_loads_128_bits_at_a_time(compiled):
    """Every pointer 16-byte aligned and n divisible by 16 (the layout's ALIGN), so each thread reads its
    elements of every array in 16-byte ld.global.v4 loads, and no scalar or 64-bit load."""
    def v4(r) -> int:
        k = per_thread(r)
        arrays = ["fp32"] * 3 + [r["grad"]] if r["kernel"] == "adamw" else [r["grad"]]  # param, m, v; grad
        return sum(k * (4 if a == "fp32" else 2) // 16 for a in arrays)
    bad = [f"{label(r)}: unhinted {sorted(set(r['pointers'] + ['n']) - set(r['hinted']))}, ld.global "
           f"v4 {r['ld_v4']} (want {v4(r)}), v2 {r['ld_v2']}, scalar {r['ld_scalar']}; sizes {r['sizes'][:4]}"
           for r in compiled["records"] if sorted(r["hinted"]) != sorted(r["pointers"] + ["n"])
           or r["ld_scalar"] or r["ld_v2"] or r["ld_v4"] != v4(r)]
    assert not bad, "\n".join(bad)


def test_a_cpu_rank_does_not_import_triton(compiled):
    """zerofunc.fused defines its kernels wherever triton imports, but imports it only when a kernel is
    asked for: a CPU rank's AdamW and unscaling take torch's paths and leave ~70 MB unspent."""
    rank = compiled["cpu_rank"]
    assert rank["triton_imported_by_cpu_step"] is False, rank
    assert rank["rss_mb_after_triton"] > rank["rss_mb_after_cpu_step"], rank
