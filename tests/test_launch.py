"""The launcher's fork server (zerofunc/launch.py): what ranks fork from must leave them able to use CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_ranks_fork_server_imports_without_asking_cuda_anything():
    """Ranks fork from a server that imports `PRELOAD` (zerofunc/launch.py). Once a process has asked
    CUDA anything (torch.cuda.is_available() included), a process forked from it cannot use CUDA:
    every rank of a GPU run would fail with "Cannot re-initialize CUDA in forked subprocess" (seen on
    the H100, docs/CUDA.md). On this CPU-only machine the question costs nothing, so the imports are
    watched instead: every torch.cuda call that reaches the driver is replaced by one that records it."""
    probe = """
import sys, torch
asked = []
for name in ("is_available", "device_count", "current_device", "init", "_lazy_init", "get_device_properties",
             "get_device_capability", "get_device_name", "set_device", "synchronize", "mem_get_info"):
    setattr(torch.cuda, name, lambda *a, _name=name, **k: asked.append(_name))
from zerofunc.launch import PRELOAD
for module in PRELOAD:
    __import__(module)
print(",".join(asked))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing the fork server's modules asked CUDA: {done.stdout.strip()}"
