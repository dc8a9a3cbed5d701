"""Run F.scaled_dot_product_attention through the kernel the target device would use.

On meta tensors SDPA decomposes to the math path, which keeps the full T x T score
matrices for backward; the fused kernels keep only the output and a log-sum-exp per
row. A simulation therefore reroutes SDPA explicitly to the target's fused op
(all have meta kernels and backward formulas), so activation memory and FLOPs are
those of the kernel the real run uses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_aten = torch.ops.aten


def _fused(kernel: str, q, k, v, dropout_p: float, is_causal: bool, scale):
    if kernel == "flash" and q.dtype not in (torch.float16, torch.bfloat16):
        kernel = "efficient"  # flash attention takes 16-bit inputs only; PyTorch runs fp32 on the efficient kernel
    if kernel == "efficient" and k.shape[-3] != q.shape[-3]:
        # grouped-query attention: the flash kernels read shared key/value heads as they are; the
        # efficient kernel cannot, so each key/value head is repeated for its group of queries
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if kernel == "flash":
        return _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if kernel == "efficient":
        return _aten._scaled_dot_product_efficient_attention(q, k, v, None, q.requires_grad, dropout_p, is_causal,
                                                             scale=scale)[0]
    if kernel == "flash_cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]
    raise ValueError(f"unknown attention kernel {kernel!r}")


class TargetAttention(TorchFunctionMode):
    """Inside this mode, unmasked SDPA runs `kernel` ("flash", "efficient", "flash_cpu"); "math" changes nothing."""

    def __init__(self, kernel: str):
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.kernel != "math" and kwargs.get("attn_mask") is None:
            q, k, v = args[:3]
            return _fused(self.kernel, q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                          kwargs.get("scale"))
        return func(*args, **kwargs)
