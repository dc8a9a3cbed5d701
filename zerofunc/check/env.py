"""What this machine runs zerofunc with, in the spirit of DeepSpeed's ds_report."""
from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Optional

import torch
import torch.distributed as dist

from zerofunc import allocator


def _version(*packages: str) -> Optional[str]:
    """The installed version of the first of `packages` found (read from metadata: importing triton costs ~80 MB)."""
    for name in packages:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(device: torch.device, compile: bool) -> dict:
    """Versions, the device and its memory, the collective backends, and which fast paths are in use."""
    from zerofunc import fused  # imports triton only where a kernel can run

    cuda = device.type == "cuda"
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton", "pytorch-triton"),
        "transformers": _version("transformers"),
        "zerofunc": _version("zerofunc") or "from the checkout (not installed)",
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU, {_cores()} cores",
        "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else _host_memory(),
        "backend": "nccl" if cuda else "gloo",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else None,
        "gloo": dist.is_gloo_available(),
        "fused_kernels": fused.use_triton(torch.empty(0, device=device)),
        "compile": compile,
        "allocator": allocator.settings() if cuda else None,
    }
    return info


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _host_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def as_text(info: dict) -> str:
    gib = info["device_memory_bytes"] / 2**30 if info["device_memory_bytes"] else None
    rows = [
        ("python", f"{info['python']} on {info['platform']}"),
        ("torch", f"{info['torch']}" + (f" (CUDA {info['torch_cuda']})" if info["torch_cuda"] else " (no CUDA build)")),
        ("triton", info["triton"] or "not installed"),
        ("transformers", info["transformers"] or "not installed"),
        ("zerofunc", info["zerofunc"]),
        ("device", info["device"] + (f", {gib:.1f} GiB" if gib else "")),
        ("collectives", f"{info['backend']}" + (f" (NCCL {info['nccl']})" if info["nccl"] else "")
         + "; simulated worlds use PyTorch's fake process group"),
        ("fused kernels", "in use (Triton)" if info["fused_kernels"] else "not in use (torch reference; Triton runs on CUDA)"),
        ("torch.compile", "on" if info["compile"] else "off"),
    ] + ([("allocator", info["allocator"] or "torch's defaults")] if info["allocator"] is not None else [])
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.rjust(width)}  {v}" for k, v in rows)
