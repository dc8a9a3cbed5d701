"""The fields of a hardware profile in profiles.json, what each must hold, and the check of an entry
against them (sim.hardware reads the files; this says what a valid entry is)."""
from __future__ import annotations

import json

FIELDS = {"description": "text", "memory_gib": "number", "reserved_gib": "number", "flops": "numbers",
          "compute_efficiency": "number", "memory_bandwidth": "number", "devices_per_node": "count",
          "intra_node": "link", "inter_node": "link", "attention": "text", "sources": "sources",
          "host_memory_gib": "number", "host_link_bandwidth": "number", "cpu_adamw_params_per_s": "number",
          "collective_staging": "numbers", "device_names": "texts", "op_overhead_s": "number",
          "overlap_hidden": "number", "nics_per_node": "count", "matmul_workspace": "numbers",
          "kernels": "object"}
OPTIONAL = ("collective_staging", "device_names", "op_overhead_s", "overlap_hidden", "nics_per_node",
            "matmul_workspace", "kernels")
REQUIRED = tuple(k for k in FIELDS if k not in OPTIONAL)
LINK_FIELDS = {"alpha_s": "number", "bandwidth": "number", "op_bandwidth": "numbers", "op_seconds": "points",
               "measured_ranks": "count", "compute_share": "number"}
_KIND_WORDS = {"number": "a number", "count": "a positive integer", "text": "a string", "texts": "a list of strings",
               "numbers": "an object of numbers", "sources": "an object of strings", "link": "an object",
               "object": "an object",
               "points": "an object of lists of [bytes, seconds] pairs"}


def check_fields(kinds: dict[str, str], entry: dict) -> None:
    unknown = sorted(set(entry) - set(kinds))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(kinds)}")
    for key, value in entry.items():
        if not _is(kinds[key], value):
            raise ValueError(f"{key} must be {_KIND_WORDS[kinds[key]]}, got {json.dumps(value)[:80]}")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is(kind: str, x) -> bool:
    if kind == "number":
        return _number(x)
    if kind == "count":
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1
    if kind == "text":
        return isinstance(x, str)
    if kind == "texts":
        return isinstance(x, list) and all(isinstance(v, str) for v in x)
    if kind == "numbers":
        return isinstance(x, dict) and all(_number(v) for v in x.values())
    if kind == "sources":
        return isinstance(x, dict) and all(isinstance(v, str) for v in x.values())
    if kind == "points":
        return isinstance(x, dict) and all(isinstance(pts, list) and all(
            isinstance(pt, list) and len(pt) == 2 and all(map(_number, pt)) for pt in pts) for pts in x.values())
    return isinstance(x, dict)  # "link", "object": their own fields are checked where they are read
