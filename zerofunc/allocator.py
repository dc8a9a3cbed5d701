"""CUDA's caching allocator as zerofunc's commands run it: expandable segments, unless the user chose.

The planner plans the bytes a step allocates; a GPU must also hold what the allocator reserves around
them, which is what runs out. With its default fixed-size segments the allocator reserved 18.5% and
21.3% above the allocated peak of zerofunc's stage-3 step at torchtitan's Llama-3.1-8B shapes (8 and
128 ranks), with expandable segments 3.8% and 4.8% (an H200, docs/CUDA.md, sixth run): a segment
that grows in place leaves no unusable tail. torchtitan's launcher sets the same.
"""
from __future__ import annotations

import os

import torch

CONFIG_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch reads either (the second, older)
DEFAULT = "expandable_segments:True"


def configure(device: torch.device) -> bool:
    """On CUDA, set `DEFAULT` unless the user set either variable (theirs is left as it is).

    Call before the process's first CUDA allocation: the setting shapes the segments mapped after
    it. The variable is set too, so what this process starts, and its report, see the same. Returns
    whether it set anything."""
    if device.type != "cuda" or any(v in os.environ for v in CONFIG_VARIABLES):
        return False
    # at run time, not only through the variable: a rank forked from a server that imported torch
    # may already have read its configuration
    # (torch's accelerator-wide setter: the CUDA one, which calls it, warns on torch 2.11, the floor)
    torch._C._accelerator_setAllocatorSettings(DEFAULT)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT
    return True


def settings() -> str:
    """The allocator's configuration as the environment gives it ("" for torch's defaults)."""
    return ",".join(os.environ[v] for v in CONFIG_VARIABLES if v in os.environ)
