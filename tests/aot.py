"""Compile zerofunc.fused's kernels for real GPUs (sm_80, sm_90) on a machine without one.

    python -m tests.aot          # a table per target: registers, spills, vector loads per kernel
    python -m tests.aot --json   # the records, one JSON object (tests/test_aot.py reads them)

Run it without TRITON_INTERPRET=1 (tests/conftest.py sets it, so tests/test_aot.py runs this
in a subprocess). The project's own wrappers, `adamw_triton_` and `unscale_triton`, are called
on CPU tensors under a stand-in driver whose target names the GPU and whose launch does
nothing. Triton's JIT then does what it does on the GPU: it specializes on the arguments
(dtypes; pointers aligned to 16 bytes; n divisible by 16), compiles TTIR -> TTGIR -> LLIR ->
PTX -> cubin with the wheel's ptxas, and runs the launcher's resource checks (shared memory
against the device's, threads per block against what the registers allow). What a driver
would report about a loaded cubin, the stand-in reads from it with the wheel's cuobjdump:
registers, local memory (spills: Triton's n_spills is the local bytes / 4) and stack.

The calls are the trainer's: every gradient and output dtype the optimizer passes, on the
flat buffers that zerofunc.layout makes of the test models' units at 1 to 8 ranks, each the
last rank's shard (stages 1-3: for fp32 stages 1-2 its master is a slice of the whole
buffer, at that offset) and the whole buffer (stage 0). Each call's compiled variant is the
one its launch was given, so every record says which shards compile to it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import types
from collections import defaultdict

import torch

from zerofunc.layout import FlatLayout
from zerofunc.optim import AdamWConfig

TARGETS = (80, 90)
SMEM = {80: 166912, 90: 232448}  # cudaDevAttrMaxSharedMemoryPerBlockOptin: A100, H100
REGS_PER_BLOCK = 65536           # sm_80 and sm_90, allocated per warp in units of 256
MAX_REGS_PER_THREAD = 255
MODELS = ("gpt2-tiny", "llama-tiny")  # llama-tiny's widths (132, 347) give odd unit sizes
WORLDS = range(1, 9)
GRADS = (torch.float32, torch.bfloat16, torch.float16)  # fp32, bf16 and fp16 training
BETA1 = (0.9, 0.3)  # the kernel's two lerp formulas (LERP_SMALL: |1 - beta1| < 0.5 or not)


def nvidia_bin() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def res_usage(cubin: bytes) -> dict:
    """REG, STACK, SHARED and LOCAL of the cubin's one kernel, as `cuobjdump -res-usage` prints them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([os.path.join(nvidia_bin(), "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    reg, stack, shared, local = map(int, re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out).groups())
    return dict(regs=reg, stack=stack, static_shared=shared, local=local)


def max_threads(regs: int) -> int:
    """CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK for a kernel of `regs` registers per thread."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(1024, REGS_PER_BLOCK // per_warp * 32) if regs <= MAX_REGS_PER_THREAD else 0


def offline_driver(cc: int, launched: list):
    """A driver for a GPU of compute capability `cc` that is not there: it loads nothing, launches nothing."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    def load_binary(name, cubin, shared, device):  # a module that is not None: Triton loads each kernel once
        use = res_usage(cubin)
        return f"offline sm_{cc}", name, use["regs"], use["local"] // 4, max_threads(use["regs"])

    class OfflineDriver(DriverBase):
        def __init__(self):
            self.target = GPUTarget("cuda", cc, 32)
            self.utils = types.SimpleNamespace(get_device_properties=lambda device: {"max_shared_mem": SMEM[cc]},
                                               load_binary=load_binary, unload_module=lambda module: None)
            # Triton makes one launcher per compiled kernel; a launch records which kernel it was
            self.launcher_cls = lambda src, metadata: (lambda *args, **kwargs: launched.append(metadata.hash))

        def is_active(self): return True
        def map_python_to_cpp_type(self, ty): raise NotImplementedError
        def get_current_target(self): return self.target
        def get_active_torch_device(self): return torch.device("cpu")
        def get_benchmarker(self): raise NotImplementedError
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0

    return OfflineDriver()


def shards() -> list[tuple[str, int, int]]:
    """(where, start, numel) of each distinct flat span the optimizer updates in the test models:
    the last rank's shard, and the whole padded buffer (stage 0)."""
    from zerofunc.api import default_units
    from zerofunc.models import build_model, model_config
    from zerofunc.units import partition
    seen, spans = set(), []
    for name in MODELS:
        with torch.device("meta"):
            model = build_model(model_config(name))
        for unit, _, named in partition(model, default_units(model)):
            for world in WORLDS:
                layout = FlatLayout.build([(n, p.shape) for n, p in named], world)
                start, stop = layout.shard_range(world - 1)
                for span in ((start, stop - start), (0, layout.padded_numel)):
                    if span not in seen:
                        seen.add(span)
                        spans.append((f"{name} {unit or '<root>'} @{world}", *span))
    return spans


def ptx_counts(ptx: str) -> dict:
    loads = re.findall(r"\bld\.global((?:\.[\w:]+)*)", ptx)
    return dict(target=re.search(r"\.target (\S+)", ptx).group(1),
                fma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
                div_rn=len(re.findall(r"\bdiv\.rn\.f32\b", ptx)),
                sqrt_rn=len(re.findall(r"\bsqrt\.rn\.f32\b", ptx)),
                approx=ptx.count(".approx"),
                # without a rounding modifier, ptxas may contract a mul and an add into an fma
                contractible=len(re.findall(r"\b(?:add|sub|mul)\.f32\b", ptx)),
                ld_v4=sum(".v4" in m for m in loads), ld_v2=sum(".v2" in m for m in loads),
                ld_scalar=sum(".v4" not in m and ".v2" not in m for m in loads))


def compile_all(cc: int) -> list[dict]:
    """Run every call the trainer makes, for target `cc`; one record per compiled kernel."""
    import triton
    import zerofunc.fused as F

    launched: list = []
    triton.runtime.driver.set_active(offline_driver(cc, launched))
    kernels = (F._adamw_kernel, F._unscale_kernel)
    for kernel in kernels:
        kernel.device_caches.clear()
    used = defaultdict(list)  # compiled kernel's hash -> the spans it was launched for
    for where, start, n in shards():
        m, v = torch.empty(n), torch.empty(n)
        for grad_dtype in GRADS:
            # fp32 stages 1-2: the master is a slice of the whole weights; anywhere else, and the
            # gradients, m, v and the output, buffers of their own
            p = torch.empty(start + n)[start:] if grad_dtype == torch.float32 else torch.empty(n)
            g = torch.empty(n, dtype=grad_dtype)
            for out in (None, torch.empty(n, dtype=grad_dtype)):  # fp32's out: the stage 1-2 send buffer
                for beta1 in BETA1:
                    F.adamw_triton_(p, g, m, v, 1, AdamWConfig(betas=(beta1, 0.999)), grad_scale=0.5, out=out)
                    used[launched[-1]].append((where, n))
        g = torch.empty(n, dtype=torch.float16)  # loss scaling: fp16 only
        for out in (None, torch.empty(n)):       # the optimizer passes none; the API allows fp32
            F.unscale_triton(g, 1 / 1024, out=out)
            used[launched[-1]].append((where, n))

    records = []
    for kernel in kernels:
        for compiled in kernel.device_caches[0][0].values():
            compiled._init_handles()  # already done at launch: Triton's checks of shared memory and threads
            names = kernel.arg_names
            sig = compiled.src.signature
            constants = {names[k[0]]: v for k, v in compiled.src.constants.items()}
            hinted = [names[k[0]] for k, v in compiled.src.attrs.items() if v]
            spans = used[compiled.metadata.hash]
            records.append(dict(
                cc=cc, kernel=compiled.name.lstrip("_").removesuffix("_kernel"),
                grad=sig["g_ptr"].lstrip("*"),
                out=sig["out_ptr"].lstrip("*") if constants.get("HAS_OUT") else None,
                lerp_small=constants.get("LERP_SMALL"),
                pointers=[a for a, t in sig.items() if t.startswith("*")], hinted=hinted,
                num_warps=compiled.metadata.num_warps, threads=compiled.metadata.num_warps * 32,
                shared=compiled.metadata.shared, max_shared=SMEM[cc], fp_fusion=compiled.metadata.enable_fp_fusion,
                n_regs=compiled.n_regs, n_spills=compiled.n_spills, max_threads=compiled.n_max_threads,
                **res_usage(compiled.kernel), **ptx_counts(compiled.asm["ptx"]),
                calls=len(spans), sizes=sorted({n for _, n in spans}),
                examples=sorted({w for w, _ in spans})[:3]))
    return records


def rss_mb() -> float:
    """Resident memory now (Linux), else the peak (which Linux would carry over from a forking parent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_rank_check() -> dict:
    """A CPU rank's AdamW step imports zerofunc.fused, but not triton (70-80 MB a rank)."""
    import zerofunc.fused as F
    n = 1 << 16
    before = rss_mb()
    F.adamw_fused_(torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n), 1, AdamWConfig())
    F.unscale_(torch.ones(n, dtype=torch.float16), 1.0)
    imported = "triton" in sys.modules
    step = rss_mb()
    F._load()
    return dict(triton_imported_by_cpu_step=imported, rss_mb_after_cpu_step=round(step, 1),
                rss_mb_step_growth=round(step - before, 1), rss_mb_after_triton=round(rss_mb(), 1))


def table(records: list[dict]) -> str:
    rows = ["| target | kernel | grad -> out | lerp | n, pointers hinted | regs | spills | shared B | ld.global v4 / scalar | calls | e.g. |",
            "|---|---|---|---|---|---:|---:|---:|---|---:|---|"]
    for r in sorted(records, key=lambda r: (r["cc"], r["kernel"], r["grad"], str(r["out"]), not r["lerp_small"],
                                            "n" not in r["hinted"])):
        hint = ("n" if "n" in r["hinted"] else "no n") + f", {sum(p in r['hinted'] for p in r['pointers'])}/{len(r['pointers'])}"
        rows.append(f"| sm_{r['cc']} | {r['kernel']} | {r['grad']} -> {r['out'] or '-'} | "
                    f"{'' if r['lerp_small'] is None else ('small' if r['lerp_small'] else 'large')} | {hint} | "
                    f"{r['regs']} | {r['local']} | {r['shared']} | {r['ld_v4']} / {r['ld_scalar']} | {r['calls']} | "
                    f"{'; '.join(r['examples'][:2])} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the records as one JSON object")
    ap.add_argument("--cc", default=",".join(map(str, TARGETS)), help="compute capabilities (default 80,90)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: interpreted kernels do not compile")
    rank = cpu_rank_check()
    records = [r for cc in map(int, args.cc.split(",")) for r in compile_all(cc)]
    if args.json:
        print(json.dumps(dict(cpu_rank=rank, records=records)))
    else:
        import triton
        print(f"triton {triton.__version__}, torch {torch.__version__}; CPU rank: {rank}\n")
        print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
