"""Session set-up that has to happen before any test imports the library."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton decides interpreted-or-compiled when @triton.jit decorates a function
    # (triton 3.9 reads TRITON_INTERPRET there), i.e. when zerofunc.fused is first
    # imported, which collecting almost any test module does. Without a GPU, the
    # interpreter is the only way the kernels run; spawned ranks inherit the setting
    # but keep to the torch reference unless ZEROFUNC_TRITON=1.
    os.environ.setdefault("TRITON_INTERPRET", "1")
