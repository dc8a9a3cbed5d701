"""Hardware profiles: what a device computes, stores and sends. Kept as data in profiles.json.

A profile gives per-device memory, sustained matmul rates per dtype, memory bandwidth,
the link within a node and the network between nodes (alpha-beta), which
attention kernel the device's PyTorch would run, and for ZeRO-Offload the host memory
per device, the host link's bandwidth and the host's AdamW rate. Each entry says where its figures
come from; figures not measured here are marked as published or assumed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from sim.cost import Link

ATTENTION_KERNELS = ("math", "flash", "efficient", "flash_cpu")


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    memory_bytes: int
    reserved_bytes: int            # taken before any tensor: CUDA context, allocator slack
    flops: dict[str, float]        # peak matmul FLOP/s per dtype ("fp32", "bf16", "fp16")
    compute_efficiency: float      # the fraction of peak a real step's matmuls reach
    memory_bandwidth: float        # bytes/s
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    attention: str
    collective_staging: dict[str, float]  # what the backend copies per collective, x payload, until it completes
    sources: dict[str, str]
    device_names: tuple[str, ...] = ()
    # ZeRO-Offload: host memory per device (on a CPU profile, the same memory as the device's),
    # the host link each way (pinned copies), and the host's fused AdamW rate per device
    host_memory_bytes: int = 0
    host_link_bandwidth: float = float("inf")
    cpu_adamw_params_per_s: float = float("inf")
    # What a step costs beyond FLOPs, bytes and the wire: per op dispatched (eager CPU: autograd's
    # bookkeeping), and the fraction of asynchronous communication that really hides behind compute
    # (a GPU's copy engines and NCCL's own SMs: all of it; a CPU rank's one core: measured)
    op_overhead_s: float = 0.0
    overlap_hidden: float = 1.0
    # substrings of the device name torch reports, to find the profile of a GPU

    def link(self, world_size: int) -> Link:
        """The ring's slowest hop: within a node if the group fits in one, else the network."""
        return self.intra_node if world_size <= self.devices_per_node else self.inter_node

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes


@cache
def profiles() -> dict[str, Profile]:
    raw = json.loads(resources.files("sim").joinpath("profiles.json").read_text())
    out = {}
    for name, p in raw.items():
        if p["attention"] not in ATTENTION_KERNELS:
            raise ValueError(f"profile {name}: unknown attention kernel {p['attention']!r}")
        out[name] = Profile(name=name, description=p["description"],
                            memory_bytes=int(p["memory_gib"] * 2**30), reserved_bytes=int(p["reserved_gib"] * 2**30),
                            flops=p["flops"], compute_efficiency=p["compute_efficiency"],
                            memory_bandwidth=p["memory_bandwidth"], devices_per_node=p["devices_per_node"],
                            intra_node=_link(p["intra_node"]), inter_node=_link(p["inter_node"]),
                            attention=p["attention"], collective_staging=p.get("collective_staging", {}),
                            sources=p["sources"], device_names=tuple(p.get("device_names", ())),
                            host_memory_bytes=int(p["host_memory_gib"] * 2**30),
                            host_link_bandwidth=p["host_link_bandwidth"], cpu_adamw_params_per_s=p["cpu_adamw_params_per_s"],
                            op_overhead_s=p.get("op_overhead_s", 0.0), overlap_hidden=p.get("overlap_hidden", 1.0))
    return out


def _link(raw: dict) -> Link:
    measured = {op: tuple((float(s), float(t)) for s, t in points) for op, points in raw.get("op_seconds", {}).items()}
    return Link(**{**raw, "op_seconds": measured})


def profile_for_device(device_name: str) -> Profile:
    """The profile of a device, by the name torch reports for it (e.g. "NVIDIA H200")."""
    for p in profiles().values():
        if any(key in device_name for key in p.device_names):
            return p
    raise ValueError(f"no hardware profile matches {device_name!r}; choose one of {', '.join(profiles())}")


def record_measured(name: str, figures: dict, source: str, path: Path | None = None) -> Path:
    """Write measured `figures` (profile fields: flops, memory_bandwidth, memory_gib) into profile `name`
    of `path` (default: the profiles.json every plan reads).

    The file is replaced whole (written beside it, then renamed), so a reader never
    sees half of it; `source` says how the figures were measured.
    """
    path = path or Path(str(resources.files("sim").joinpath("profiles.json")))
    raw = json.loads(path.read_text())
    if name not in raw:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(raw)}")
    entry = raw[name]
    for key, value in figures.items():
        entry[key] = {**entry[key], **value} if isinstance(value, dict) else value
    entry["sources"] = {"measured: " + ", ".join(figures): source,
                        **{k: v for k, v in entry["sources"].items() if not k.startswith("measured: ")}}
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    tmp.replace(path)
    profiles.cache_clear()
    return path


def get_profile(name: str) -> Profile:
    table = profiles()
    if name not in table:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(table)}")
    return table[name]
