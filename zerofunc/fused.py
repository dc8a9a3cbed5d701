"""Fused kernels for the element-wise work between collectives, each beside its torch reference.

Between the reduce-scatter of gradients and the all-gather of weights, a ZeRO step
only streams flat buffers: check and unscale fp16 gradients, then AdamW on the fp32
master shard, then round it to 16 bits for the forward or for the all-gather. As
separate torch ops that is about ten passes over memory and several shard-sized
temporaries; fused, it is one pass per kernel and no temporaries.

Each kernel has a torch reference with the same signature, which the kernel is tested
against. `adamw_fused_` and `unscale_` pick one: the Triton kernel on CUDA; elsewhere
the reference, except that AdamW on CPU and on meta tensors (the planner simulates a
step with them, so their memory is what is predicted) runs torch's fused CPU kernel;
`ZEROFUNC_TRITON=0` forces the reference, and `ZEROFUNC_TRITON=1` with
`TRITON_INTERPRET=1` runs the kernels on CPU through Triton's interpreter (tests).

The kernels are defined wherever triton imports, so they also compile for sm_80 and
sm_90 on a machine without a GPU (tests/aot.py, docs/CUDA.md); but triton is imported
only where a kernel may run (CUDA, the interpreter) or when one is first asked for.
"""
from __future__ import annotations

import importlib
import math
import os
from typing import Optional

import torch

from zerofunc.optim import AdamWConfig, adamw_

BLOCK = 1024  # elements per program; one fixed size: @triton.autotune fails in the interpreter

# triton, tl, INTERPRETED and the kernels are module globals that `_load` sets on first need.
_loaded: Optional[bool] = None  # None: not tried yet; then whether triton imported


def _load() -> bool:
    """Import triton and define the kernels (at the end of this file), once; whether they are defined.

    Wherever triton imports, the kernels are defined: compiled for the GPU, interpreted
    under TRITON_INTERPRET=1 (Triton 3.9 reads it when @triton.jit decorates), or
    compiled ahead of time for a GPU on a machine without one (tests/aot.py). But only
    on first need, because importing triton costs each rank 70-80 MB of resident memory:
    a CPU rank that never runs a kernel never pays it.
    """
    global _loaded, triton, tl, INTERPRETED
    if _loaded is None:
        try:
            triton = importlib.import_module("triton")
            tl = importlib.import_module("triton.language")
        except ImportError:  # the library works without triton; only the fused path needs it
            triton = tl = None
        INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
        if triton is not None:
            _define_kernels()
        _loaded = triton is not None
    return _loaded


def __getattr__(name: str):
    """`fused.triton`, `fused.INTERPRETED`, `fused._adamw_kernel`...: loaded when first asked for."""
    if name in ("triton", "tl", "INTERPRETED", "_adamw_kernel", "_unscale_kernel") and _loaded is None:
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the kernels can and should run on `tensor`'s device.

    CUDA takes the kernel unless `ZEROFUNC_TRITON=0`. CPU takes it only when asked
    (`ZEROFUNC_TRITON=1`) and the kernels were defined interpreted. Meta never does:
    the planner needs the reference's allocations, and a kernel cannot launch on meta.
    Asked about a CPU tensor, this imports triton only where the answer can be yes.
    """
    flag = os.environ.get("ZEROFUNC_TRITON", "")
    if flag == "0":
        return False
    if tensor.device.type == "cuda":
        return _load()
    if tensor.device.type != "cpu" or flag != "1":
        return False
    if _loaded is None and os.environ.get("TRITON_INTERPRET") != "1":
        return False  # defined now, the kernels would compile for a GPU, not run here
    return _load() and INTERPRETED


# ---- AdamW -------------------------------------------------------------------------------
@torch.no_grad()
def adamw_reference_(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                     cfg: AdamWConfig, lr: Optional[float] = None, grad_scale: float = 1.0,
                     out: Optional[torch.Tensor] = None) -> None:
    """AdamW with the gradient `grad.float() * grad_scale`, then `out.copy_(param)`.

    `grad_scale` carries 1 / loss scale and the clip coefficient, so a 16-bit
    gradient is never unscaled into a second buffer first. `out` receives the new
    weights in its own dtype: the 16-bit weights the forward uses, or the send buffer
    of the all-gather. The input `grad` is not modified, so an fp32 gradient with
    grad_scale != 1 costs one shard-sized temporary here (the kernel needs none).
    """
    g = grad.float() if grad_scale == 1.0 else grad.float() * grad_scale
    adamw_(param, g, m, v, step, cfg, lr=lr)
    if out is not None:
        out.copy_(param)


def adamw_triton_(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                  cfg: AdamWConfig, lr: Optional[float] = None, grad_scale: float = 1.0,
                  out: Optional[torch.Tensor] = None) -> None:
    """`adamw_reference_` in one pass: reads param, grad, m, v; writes param, m, v and out.

    Whatever depends on the step (bias corrections, step size) is a scalar computed
    here in Python floats and rounded to fp32 at launch, as torch rounds the scalars
    of `adamw_`'s ops.
    """
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    _require()
    n = param.numel()
    _check_flat(n, param, grad, m, v, out)
    if any(t.dtype != torch.float32 for t in (param, m, v)):
        raise TypeError("param, m and v must be fp32")
    if n == 0:
        return
    lr = cfg.lr if lr is None else lr
    beta1, beta2 = cfg.betas
    w = 1 - beta1  # lerp weight; torch's lerp switches formula at |w| = 0.5
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, m, v, param if out is None else out, n,
        float(grad_scale), 1 - lr * cfg.weight_decay, w, beta2, 1 - beta2,
        -lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step), cfg.eps,
        LERP_SMALL=abs(w) < 0.5, HAS_OUT=out is not None,
        ROUND_BF16=INTERPRETED and out is not None and out.dtype == torch.bfloat16,
        BLOCK=BLOCK, enable_fp_fusion=False)


def adamw_fused_(param, grad, m, v, step, cfg, lr=None, grad_scale=1.0, out=None) -> None:
    """AdamW on a flat fp32 shard (see `adamw_reference_`): the Triton kernel where `use_triton`
    says so, else torch's fused kernel on CPU and meta (the planner's), else the reference."""
    if use_triton(param):
        impl = adamw_triton_
    elif param.device.type in ("cpu", "meta"):
        impl = adamw_torch_fused_
    else:
        impl = adamw_reference_
    impl(param, grad, m, v, step, cfg, lr=lr, grad_scale=grad_scale, out=out)


@torch.no_grad()
def adamw_torch_fused_(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                       cfg: AdamWConfig, lr: Optional[float] = None, grad_scale: float = 1.0,
                       out: Optional[torch.Tensor] = None) -> None:
    """`adamw_reference_` through torch's fused AdamW (`torch._fused_adamw_`, vectorized on CPU): one
    pass over param, grad, m and v instead of the reference's seven, and no temporary for an fp32
    gradient. The kernel divides the gradient by its `grad_scale`, so it is given 1 / grad_scale:
    within an ulp of the reference's product, and exactly it for powers of two."""
    lr = cfg.lr if lr is None else lr
    g = grad if grad.dtype == torch.float32 else grad.float()  # the kernel takes one dtype
    scale = None if grad_scale == 1.0 else torch.full((), 1.0 / grad_scale, device=param.device)
    steps = torch.full((), float(step), device=param.device)
    torch._fused_adamw_([param], [g], [m], [v], [], [steps], amsgrad=False, lr=lr, beta1=cfg.betas[0],
                        beta2=cfg.betas[1], weight_decay=cfg.weight_decay, eps=cfg.eps, maximize=False,
                        grad_scale=scale)
    if out is not None:
        out.copy_(param)


# ---- unscaling with a finite check -----------------------------------------------------------
@torch.no_grad()
def unscale_reference(grad: torch.Tensor, inv_scale: float,
                      out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscale an (fp16) gradient into `out` (fp32); (sum of squares, found_inf), 1-element fp32.

    Both are what the caller all-reduces: sq_sum for the global norm (clipping),
    found_inf (1.0 if any unscaled element is inf or nan) for the overflow decision.
    Checking the unscaled values covers the raw ones: inf * s and nan * s stay
    non-finite. With `out=None` nothing is written and no fp32 copy is made: the norm
    of `grad` is scaled instead of the elements, equal up to rounding.
    """
    if out is not None:
        _check_flat(grad.numel(), grad, out)
        x = out.copy_(grad).mul_(inv_scale)  # exact widening, then one fp32 rounding
        sq = torch.dot(x, x)
        peak = torch.linalg.vector_norm(x, float("inf"))
    else:
        sq = (torch.linalg.vector_norm(grad, dtype=torch.float32) * inv_scale).square()
        peak = torch.linalg.vector_norm(grad, float("inf"), dtype=torch.float32) * inv_scale
    found_inf = torch.isfinite(peak).logical_not().float()  # the max propagates nan
    return sq.reshape(1), found_inf.reshape(1)


def unscale_triton(grad: torch.Tensor, inv_scale: float,
                   out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`unscale_reference` in one pass over `grad`.

    Each program writes its block's partial sum and finite flag to a small buffer that
    torch then sums, rather than atomically adding into one scalar: atomics would
    add blocks in a different order every run, and the clip coefficient, hence the
    whole update, would not be reproducible bit for bit.
    """
    _require()
    n = grad.numel()
    _check_flat(n, grad, out)
    if out is not None and out.dtype != torch.float32:
        raise TypeError("out must be fp32")
    blocks = triton.cdiv(n, BLOCK)
    partials = torch.zeros(2, max(blocks, 1), device=grad.device, dtype=torch.float32)
    if n:
        _unscale_kernel[(blocks,)](grad, grad if out is None else out, partials, n, float(inv_scale), blocks,
                                   HAS_OUT=out is not None, BLOCK=BLOCK, enable_fp_fusion=False)
    return partials[0].sum().reshape(1), partials[1].amax().reshape(1)


def unscale_(grad, inv_scale, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sq_sum, found_inf) of `grad * inv_scale`, optionally written to `out`; fused where `use_triton` says so."""
    return (unscale_triton if use_triton(grad) else unscale_reference)(grad, inv_scale, out)


def _require() -> None:
    if not _load():
        raise RuntimeError("the fused kernels need triton: pip install triton")


def _check_flat(n: int, *tensors: Optional[torch.Tensor]) -> None:
    for t in tensors:
        if t is not None and (t.numel() != n or not t.is_contiguous()):
            raise ValueError(f"expected contiguous tensors of {n} elements, got {tuple(t.shape)}")


def _define_kernels() -> None:
    """The kernels, defined by `_load` once triton is imported. Their `tl` is this module's global."""
    global _adamw_kernel, _unscale_kernel

    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n, grad_scale, decay, w, beta2, one_minus_beta2,
                      neg_step_size, bc2_sqrt, eps,
                      LERP_SMALL: tl.constexpr, HAS_OUT: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):
        # torch's ops in torch's order: separate roundings where torch has separate ops,
        # an fma where torch's CPU kernels use one (lerp, addcmul); the launch disables
        # fp contraction so that the compiler adds no others. IEEE sqrt and division.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p * decay                                  # decoupled weight decay
        if LERP_SMALL:                                 # m.lerp_(g, w)
            m = tl.fma(w, g - m, m)
        else:
            m = tl.fma(w - 1.0, g - m, g)
        v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # v.mul_(b2).addcmul_(g, g, 1 - b2)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p + tl.div_rn(neg_step_size * m, denom)    # p.addcdiv_(m, denom, -step_size)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if ROUND_BF16:  # the interpreter truncates fp32 -> bf16; round to nearest even, as a GPU does
            bits = p.to(tl.uint32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            tl.store(out_ptr + offs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        elif HAS_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _unscale_kernel(g_ptr, out_ptr, partials_ptr, n, inv_scale, blocks,
                        HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
        if HAS_OUT:
            tl.store(out_ptr + offs, x, mask=mask)
        # not (|x| <= max float) is true exactly for inf and nan; masked lanes hold 0
        bad = tl.where(tl.abs(x) <= 3.4028234663852886e38, 0.0, 1.0)
        tl.store(partials_ptr + pid, tl.sum(x * x, axis=0))
        tl.store(partials_ptr + blocks + pid, tl.max(bad, axis=0))


# Interpreted kernels are defined at import, as Triton decides interpreted-or-not at decoration. On CUDA
# `use_triton` defines them on first need: asking torch.cuda.is_available() here would initialize CUDA's
# driver in every importer, a rank's fork server included, and a rank forked from it could not use CUDA.
if os.environ.get("TRITON_INTERPRET") == "1":
    _load()
