"""zerofunc.fused: each Triton kernel against its torch reference, and the optimizer on the kernels.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py switches it on
before anything imports zerofunc.fused), so these tests run, not skip, on CPU-only CI;
on a CUDA machine the same tests run the compiled kernels. Sizes stay small (the
interpreter runs one program at a time in numpy) but cover 1 element, a partial block,
and several blocks with a tail.

Tolerance, where kernel and reference may round differently: the kernel performs the
reference's operations in its order with the same fp32 roundings, and an fma exactly
where torch's CPU kernels use one (lerp, addcmul). What still differs: torch's CPU sqrt
is not always correctly rounded (1 ulp off for ~0.5% of inputs here), the kernel's is,
and a GPU reference or a scalar tail loop may fuse differently. Each such difference is
one ulp of an intermediate, which moves a result by about an ulp of what it adds: of
the step's update (at most lr times a few, < 1 here) for the parameter, of m or v
themselves for the moments. Over at most 4 steps that stays within a few ulps
(2^-23 = 1.2e-7 each) of max(1, max|x|), so 1e-6 of that bounds it, as
tests/test_optim.py bounds adamw_ against torch.optim.AdamW. A dropped weight decay
(lr*wd, typically ~1e-3 of the value) or bias correction is far larger.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import bare
from tests.bare import GUARD, close, in_world
from zerofunc import fused
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.layout import shard
from zerofunc.loss_scale import LossScaler
from zerofunc.models import GPT, model_config
from zerofunc.optim import AdamWConfig, adamw_
from zerofunc.stages import STAGES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B = fused.BLOCK
sizes = st.sampled_from([1, 2, 7, B - 1, B, B + 1, 2 * B + 3, 3000]) | st.integers(1, 3000)
grad_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
out_dtypes = st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32])
betas_choices = st.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.5, 0.9), (0.0, 0.99), (0.8, 0.99)])


def guarded(n: int, dtype: torch.dtype, fill=None):
    return bare.guarded(n, dtype, fill, DEVICE)


def test_the_kernels_really_run_interpreted_without_a_gpu():
    assert fused.triton is not None, "triton is not installed: pip install -e '.[test]'"
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        assert fused.INTERPRETED and isinstance(fused._adamw_kernel, InterpretedFunction), \
            "TRITON_INTERPRET=1 was not set before zerofunc.fused was imported (see tests/conftest.py)"
    (p, p_guard), (m, m_guard), (v, v_guard) = (guarded(3, torch.float32, fill) for fill in (1.0, 0.0, 0.0))
    fused.adamw_triton_(p, torch.ones(3, device=DEVICE), m, v, 1, AdamWConfig(lr=0.1, weight_decay=0.0))
    assert torch.allclose(p, torch.full_like(p, 0.9)) and torch.allclose(m, torch.full_like(m, 0.1))
    assert all(torch.all(g == GUARD) for g in (p_guard, m_guard, v_guard)), "wrote past the end"


@settings(max_examples=150, deadline=None)
@given(n=sizes, grad_dtype=grad_dtypes, out_dtype=out_dtypes, betas=betas_choices, steps=st.integers(1, 4),
       lr=st.floats(1e-4, 1e-1), weight_decay=st.floats(0.0, 0.2), eps=st.sampled_from([1e-8, 1e-6]),
       grad_scale=st.sampled_from([1.0, 2.0**-12, 0.37, 3.0]), seed=st.integers(0, 2**31 - 1))
def test_adamw_kernel_matches_the_reference(n, grad_dtype, out_dtype, betas, steps, lr, weight_decay, eps,
                                            grad_scale, seed):
    cfg = AdamWConfig(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=gen).to(DEVICE)
    ref = init.clone(), torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)  # param, m, v
    ours, guards = zip(*(guarded(n, torch.float32, fill) for fill in (init, 0.0, 0.0)))
    ref_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype, device=DEVICE)
    out, out_guard = (None, None) if out_dtype is None else guarded(n, out_dtype)
    for step in range(1, steps + 1):
        grad = (torch.randn(n, generator=gen) * 3).to(DEVICE, grad_dtype)
        for (param, m, v), impl, dst in ((ref, fused.adamw_reference_, ref_out), (ours, fused.adamw_triton_, out)):
            impl(param, grad, m, v, step, cfg, grad_scale=grad_scale, out=dst)
        for label, a, b in zip(("param", "m", "v"), ours, ref):
            ok, diff, tol = close(a, b)
            assert ok, f"step {step}: {label} differs by {diff:.3g} > {tol:.3g}"
        if out is not None:  # the 16-bit copy is exactly the rounding of the kernel's own result
            assert torch.equal(out, ours[0].to(out_dtype)), f"step {step}: out is not param.to({out_dtype})"
            assert torch.equal(ref_out, ref[0].to(out_dtype))
    for guard in guards + ((out_guard,) if out is not None else ()):
        assert torch.all(guard == GUARD), "wrote past the end"
    # the kernel ran: its first moment moved (the parameter's own net update can cancel to the bit over a few steps)
    assert not torch.equal(ours[1], torch.zeros_like(ours[1]))


@pytest.mark.parametrize("grad_dtype, grad_scale", [(torch.float32, 1.0), (torch.float32, 0.73),
                                                    (torch.bfloat16, 0.25), (torch.float16, 0.37)])
def test_torch_fused_adamw_is_the_reference_within_an_ulp(grad_dtype, grad_scale):
    """The CPU update (torch's fused kernel, given 1 / grad_scale) against the reference, 3 steps of a
    shard that is no multiple of any vector width."""
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(10_007, generator=gen)
    ref, ours = ([init.clone(), torch.zeros(10_007), torch.zeros(10_007)] for _ in range(2))
    ref_out, out = torch.empty(10_007, dtype=torch.bfloat16), torch.empty(10_007, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        grad = torch.randn(10_007, generator=gen).to(grad_dtype)
        fused.adamw_reference_(*ref[:1], grad, *ref[1:], step, cfg, grad_scale=grad_scale, out=ref_out)
        fused.adamw_torch_fused_(*ours[:1], grad, *ours[1:], step, cfg, grad_scale=grad_scale, out=out)
    for a, b in zip(ours, ref):
        ok, diff, tol = close(a, b)
        assert ok, (diff, tol)
    assert (out.float() - ref_out.float()).abs().max() <= 2 ** -7 * ref_out.float().abs().max()  # one bf16 ulp


def test_adamw_reference_is_adamw_on_the_scaled_gradient_and_runs_on_meta():
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    init, grad = torch.randn(100, generator=gen), torch.randn(100, generator=gen).half()
    p, m, v = init.clone(), torch.zeros(100), torch.zeros(100)
    out = torch.empty(100, dtype=torch.bfloat16)
    fused.adamw_reference_(p, grad, m, v, 1, cfg, grad_scale=0.25, out=out)
    q, mq, vq = init.clone(), torch.zeros(100), torch.zeros(100)
    adamw_(q, grad.float() * 0.25, mq, vq, 1, cfg)
    assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq) and torch.equal(out, q.bfloat16())
    with torch.device("meta"):
        p, m, v, g, out = torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.zeros(5).half(), torch.empty(5).half()
    assert not fused.use_triton(p)
    fused.adamw_fused_(p, g, m, v, 1, cfg, grad_scale=0.5, out=out)
    assert all(t.shape == (1,) and t.device.type == "meta" for t in fused.unscale_(g, 0.5))


@settings(max_examples=150, deadline=None)
@given(n=sizes, grad_dtype=grad_dtypes, inv_scale=st.sampled_from([1.0, 2.0**-16, 0.3]), write=st.booleans(),
       specials=st.lists(st.sampled_from([math.inf, -math.inf, math.nan, 65504.0, 7e4]), max_size=3),
       data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_unscale_kernel_matches_the_reference(n, grad_dtype, inv_scale, write, specials, data, seed):
    """Clean gradients: found_inf 0 and the same sum of squares; any inf or nan (7e4 is inf in fp16): found_inf 1."""
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 100
    for value in specials:
        grad[data.draw(st.integers(0, n - 1), label="at")] = value
    grad = grad.to(DEVICE, grad_dtype)
    unscaled = grad.float() * inv_scale
    expect_inf = float(not torch.isfinite(unscaled).all())

    ref_out = torch.empty(n, device=DEVICE) if write else None
    out, out_guard = guarded(n, torch.float32) if write else (None, None)
    ref_sq, ref_inf = fused.unscale_reference(grad, inv_scale, ref_out)
    sq, found_inf = fused.unscale_triton(grad, inv_scale, out)

    assert found_inf.item() == ref_inf.item() == expect_inf
    assert sq.shape == found_inf.shape == (1,) and sq.dtype == found_inf.dtype == torch.float32
    if expect_inf:
        assert not math.isfinite(sq.item()) and not math.isfinite(ref_sq.item())
    else:
        # n positive terms summed in fp32 in any order, each squared with one rounding: a
        # relative error below (n + 1) * 2^-24; the reference without `out` scales a norm
        # (a sqrt and a square: 2 more roundings).
        exact = unscaled.double().square().sum().item()
        for got in (sq.item(), ref_sq.item()):
            assert abs(got - exact) <= (n + 4) * 2.0**-24 * exact, (got, exact)
    if write:
        torch.testing.assert_close(out, unscaled, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(ref_out, unscaled, rtol=0, atol=0, equal_nan=True)
        assert torch.all(out_guard == GUARD), "wrote past the end of out"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, interpreting 1e30 ** 2
@pytest.mark.parametrize("unscale", [fused.unscale_reference, fused.unscale_triton])
def test_unscale_overflow_examples(unscale):
    def run(values, dtype, inv=2.0**-10):
        sq, found_inf = unscale(torch.tensor(values, dtype=dtype, device=DEVICE), inv)
        return sq.item(), found_inf.item()

    assert run([1.0, -2.0, 65504.0], torch.float16) == pytest.approx((1 / 2**20 * (1 + 4 + 65504.0**2), 0.0))
    assert run([1.0, 7e4], torch.float16)[1] == 1.0        # overflowed fp16: inf
    assert run([1.0, math.nan], torch.bfloat16)[1] == 1.0
    assert run([0.0] * 2000 + [-math.inf], torch.float16)[1] == 1.0  # in the second block
    sq, found_inf = run([1e30, 1.0], torch.float32, inv=1.0)  # finite values whose squares overflow
    assert found_inf == 0.0 and sq == math.inf


def test_dispatch(monkeypatch):
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    monkeypatch.delenv("ZEROFUNC_TRITON", raising=False)
    assert not fused.use_triton(cpu) and not fused.use_triton(meta)
    if torch.cuda.is_available():
        assert fused.use_triton(torch.zeros(2, device="cuda"))
    monkeypatch.setenv("ZEROFUNC_TRITON", "1")
    assert fused.use_triton(cpu) == fused.INTERPRETED and not fused.use_triton(meta)
    calls = []
    monkeypatch.setattr(fused, "unscale_triton", lambda *a: calls.append("triton"))
    monkeypatch.setattr(fused, "unscale_reference", lambda *a: calls.append("reference"))
    fused.unscale_(cpu, 1.0)
    monkeypatch.setenv("ZEROFUNC_TRITON", "0")
    fused.unscale_(cpu, 1.0)
    assert not fused.use_triton(cpu)
    if torch.cuda.is_available():
        assert not fused.use_triton(torch.zeros(2, device="cuda"))
    assert calls == ["triton" if fused.INTERPRETED else "reference", "reference"]


def steps_on_both_paths() -> list:
    """Per stage and precision, with clipping: one step, then one whose gradient overflows
    on the last rank, once on the torch reference and once on the kernels."""
    comm = DistCommunicator()
    last = comm.rank == comm.world_size - 1
    with torch.device("meta"):
        model = GPT(model_config("gpt2-tiny", n_layer=1, n_embd=24, n_head=2, vocab_size=29, block_size=8))
    x = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(comm.rank))
    report = []
    for stage in STAGES:
        for precision in ("fp32", "bf16", "fp16"):
            runs = {}
            for flag in ("0", "1"):
                os.environ["ZEROFUNC_TRITON"] = flag
                scaler = LossScaler(scale=2.0**10, hysteresis=1) if precision == "fp16" else None
                engine = ZeroEngine(model, STAGES[stage], comm, AdamWConfig(lr=1e-2), precision=precision,
                                    clip=0.05, loss_scaler=scaler, init=lambda n, s: model.init_param(n, s, 0))
                stepped = []
                for overflow in (False, True):
                    loss = engine(x[:, :-1], x[:, 1:])
                    inject = overflow and last and precision == "fp16"
                    engine.backward(loss * float("inf") if inject and stage == 0 else loss)  # all-reduced
                    if inject and stage > 0:
                        engine.units[-1].grad[0] = float("inf")  # one element of one rank's shard
                    stepped.append(engine.step())
                    if not overflow:
                        params = engine.full_parameters()
                # The weights the forward uses are the rounding of this rank's master.
                rounded = all(torch.equal(shard(u.params, comm.rank, comm.world_size)
                                          if STAGES[stage].shard_optimizer and not STAGES[stage].shard_params
                                          else u.params, u.master.to(u.params.dtype)) for u in engine.units)
                assert fused.use_triton(engine.units[0].master) == (flag == "1"), "not the path asked for"
                runs[flag] = (params, engine.full_parameters(), stepped, rounded)
            ref, ours = runs["0"], runs["1"]
            err = max((ours[0][k] - ref[0][k]).abs().max().item() / max(1.0, ref[0][k].abs().max().item())
                      for k in ref[0])
            unchanged = all(torch.equal(ours[0][k], ours[1][k]) for k in ours[0]) if precision == "fp16" else True
            report.append((stage, precision, err, ours[2], ref[2], ours[3], unchanged))
    os.environ.pop("ZEROFUNC_TRITON")
    return report


@pytest.mark.skipif(not fused.INTERPRETED, reason="ranks train on CPU; with a GPU the kernels compile for CUDA")
@pytest.mark.slow
def test_the_optimizer_steps_alike_on_the_kernels_and_on_the_reference():
    """The wiring: 16-bit weights (stages 0, 3) or the all-gathered send buffer (stages 1, 2)
    come out of the kernel; fp16 overflow is found by the unscale kernel on any rank."""
    for report in in_world(2, steps_on_both_paths):
        for stage, precision, err, stepped, ref_stepped, rounded, unchanged in report:
            case = f"stage {stage} {precision}"
            assert err <= 1e-6, f"{case}: kernels differ from the reference by {err:.3g}"
            assert stepped == ref_stepped == [True, precision != "fp16"], f"{case}: {stepped} vs {ref_stepped}"
            assert rounded, f"{case}: the forward's weights are not the masters' rounding"
            assert unchanged, f"{case}: the overflowed step changed the weights"
