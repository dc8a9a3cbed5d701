"""Hardware profiles: what a device computes, stores and sends. Kept as data in profiles.json.

A profile gives per-device memory, sustained matmul rates per dtype, memory bandwidth,
the link within a node and the network between nodes (alpha-beta), and which
attention kernel the device's PyTorch would run. Each entry says where its figures
come from; figures not measured here are marked as published or assumed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

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
                            intra_node=Link(**p["intra_node"]), inter_node=Link(**p["inter_node"]),
                            attention=p["attention"], collective_staging=p.get("collective_staging", {}),
                            sources=p["sources"])
    return out


def get_profile(name: str) -> Profile:
    table = profiles()
    if name not in table:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(table)}")
    return table[name]
