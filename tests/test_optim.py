"""adamw_ against torch.optim.AdamW's single-tensor path, and its element-wise nature."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofunc.optim import AdamWConfig, adamw_

betas_choices = st.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.8, 0.99), (0.5, 0.9), (0.0, 0.99)])


def max_abs(x: torch.Tensor) -> float:
    return x.abs().max().item()


def close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float, float]:
    diff = (a - b).abs().max().item()
    tol = 1e-6 * max(1.0, max_abs(b))
    return diff <= tol, diff, tol


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 300),
    lr=st.floats(1e-4, 1e-1),
    weight_decay=st.floats(0.0, 0.2),
    betas=betas_choices,
    eps=st.sampled_from([1e-8, 1e-6]),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_adamw_matches_torch(n, lr, weight_decay, betas, eps, steps, seed):
    g = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=g)

    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            foreach=False, fused=False)

    cfg = AdamWConfig(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    param = init.clone()
    m = torch.zeros(n)
    v = torch.zeros(n)

    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=g)
        ref.grad = grad.clone()
        opt.step()
        adamw_(param, grad, m, v, step, cfg)

        state = opt.state[ref]
        for label, ours, theirs in (("param", param, ref.detach()),
                                    ("exp_avg", m, state["exp_avg"]),
                                    ("exp_avg_sq", v, state["exp_avg_sq"])):
            ok, diff, tol = close(ours, theirs)
            assert ok, f"step {step}: {label} differs by {diff:.3g} > {tol:.3g}"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 300),
    data=st.data(),
    lr=st.floats(1e-4, 1e-1),
    weight_decay=st.floats(0.0, 0.2),
    betas=betas_choices,
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_split_update_is_bitwise_equal_to_whole(n, data, lr, weight_decay, betas, steps, seed):
    cut = data.draw(st.sampled_from([n // 2]) | st.integers(1, n - 1), label="cut")
    cfg = AdamWConfig(lr=lr, betas=betas, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=g)

    whole_p, whole_m, whole_v = init.clone(), torch.zeros(n), torch.zeros(n)
    split_p, split_m, split_v = init.clone(), torch.zeros(n), torch.zeros(n)
    halves = [slice(0, cut), slice(cut, n)]

    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=g)
        adamw_(whole_p, grad, whole_m, whole_v, step, cfg)
        for sl in halves:
            # Slices are views: each half updates its own part of the split buffers.
            adamw_(split_p[sl], grad[sl], split_m[sl], split_v[sl], step, cfg)

        assert torch.equal(split_p, whole_p), f"step {step}: param"
        assert torch.equal(split_m, whole_m), f"step {step}: m"
        assert torch.equal(split_v, whole_v), f"step {step}: v"
    # The update did something, so equality is not vacuous.
    assert not torch.equal(whole_p, init)


@pytest.mark.parametrize("step", [0, -1, -5])
def test_step_below_one_raises(step):
    p, g, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError):
        adamw_(p, g, m, v, step, AdamWConfig())
    # Nothing was touched before the check.
    assert torch.equal(p, torch.ones(4))
    assert torch.equal(m, torch.zeros(4))


def test_negative_lr_raises():
    with pytest.raises(ValueError):
        AdamWConfig(lr=-1)
    with pytest.raises(ValueError):
        AdamWConfig(lr=float("nan"))
