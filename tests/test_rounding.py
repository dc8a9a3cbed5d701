"""The rounding budgets of tests/rounding.py hold for every fp32 implementation the engine runs, on
inputs chosen to stress them, and are tight enough that a wrong update or reduction breaks them."""
from __future__ import annotations

import pytest
import torch

from tests.bare import OPTIM
from tests.rounding import adamw_exact, clip_factor_error, reduction_budget
from zerofunc.fused import adamw_reference_, adamw_torch_fused_
from zerofunc.optim import AdamWConfig


def hard_state(n: int, seed: int):
    """fp32 AdamW state that stresses the budget: gradients from 1e-12 to 1 (around eps and far
    below it), first moments that nearly cancel the new gradient, second moments near zero."""
    gen = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (-12 * torch.rand(n, generator=gen, dtype=torch.float64))
    g = (mag * torch.randn(n, generator=gen, dtype=torch.float64)).float()
    p = torch.randn(n, generator=gen).float() * 0.1
    m = (-g.double() * (1 + 1e-3 * torch.randn(n, generator=gen, dtype=torch.float64))).float()
    v = (g.double() ** 2 * torch.rand(n, generator=gen, dtype=torch.float64)).float()
    return p, g, m, v


def offload_update(p, g, m, v, step, cfg, lr, grad_scale):  # zerofunc/offload.py's arithmetic
    g = g.clone().mul_(grad_scale)
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.full((), float(step))], amsgrad=False, lr=lr,
                        beta1=cfg.betas[0], beta2=cfg.betas[1], weight_decay=cfg.weight_decay, eps=cfg.eps,
                        maximize=False)


IMPLS = {"torch fused (CPU default)": lambda p, g, m, v, s, c, lr, f: adamw_torch_fused_(p, g, m, v, s, c, lr, f),
         "reference": lambda p, g, m, v, s, c, lr, f: adamw_reference_(p, g, m, v, s, c, lr, f),
         "offload": offload_update}


def worst(impl, cfg: AdamWConfig, factor: float, step: int, seed: int, plant=None) -> float:
    """Largest |fp32 result - exact| / budget over a hard state: the weights, and the moments kept for the next step."""
    p, g, m, v = hard_state(4099, seed)
    exact = adamw_exact(p, g, m, v, step, cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay,
                        factor, clip_factor_error(g.numel(), 1, 1))
    args = plant(p, g, m, v, step) if plant is not None else (p, g, m, v, step)
    impl(*args, cfg, cfg.lr, factor)  # in place: p, m and v are read back below, whatever a plant handed it
    return max(((got.double() - want).abs() / budget).nan_to_num(nan=0.0).max().item()
               for got, want, budget in ((p, exact.p, exact.p_budget), (m, exact.m, exact.m_budget),
                                         (v, exact.v, exact.v_budget)))


@pytest.mark.parametrize("name", list(IMPLS))
@pytest.mark.parametrize("cfg", [OPTIM, AdamWConfig(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)])
def test_every_fp32_adamw_stays_within_its_budget(name, cfg):
    """Several seeds, steps 1 and 7, clipped and not: the budget is never exceeded."""
    for seed in range(3):
        for step in (1, 7):
            for factor in (1.0, 0.3):
                assert worst(IMPLS[name], cfg, factor, step, seed) <= 1.0, (name, cfg, seed, step, factor)


@pytest.mark.parametrize("plant", [
    lambda p, g, m, v, s: (p, g.roll(1), m, v, s),              # each element updated with its neighbour's gradient
    lambda p, g, m, v, s: (p, g * 1.001, m, v, s),              # the gradient 0.1% off (a clip coefficient wrong)
    lambda p, g, m, v, s: (p, g, m, v, s + 1),                  # the bias correction of the wrong step
    lambda p, g, m, v, s: (p, g, m.clone(), v, s),              # the first moment never written back
    lambda p, g, m, v, s: (p, g, m, v.clone(), s),              # the second moment never written back
], ids=["neighbour's gradient", "gradient 0.1% off", "step off by one", "m not kept", "v not kept"])
def test_a_wrong_update_breaks_the_budget(plant):
    assert worst(IMPLS["torch fused (CPU default)"], OPTIM, 1.0, 2, 0, plant) > 1.0


def test_reductions_in_any_order_stay_within_their_budget_and_a_missing_mean_does_not():
    """k fp32 terms that cancel, summed in several orders and trees and divided by N as the
    engine's collectives do, against the exact mean; then without the division by N."""
    gen = torch.Generator().manual_seed(0)
    for ranks, accum in [(2, 1), (3, 2), (4, 3)]:
        terms = torch.randn(ranks * accum, 5000, generator=gen) * 10.0 ** torch.randint(-6, 1, (1, 5000), generator=gen)
        terms[-1] = -terms[:-1].sum(0) * (1 + 1e-4)  # the sum cancels to ~1e-4 of its terms
        exact = terms.double().sum(0) / ranks
        budget = reduction_budget(terms.double().abs().sum(0) / ranks, ranks * accum)
        orders = [terms, terms.flip(0), terms[torch.randperm(len(terms), generator=gen)]]
        for t in orders:  # sequentially, then per rank and averaged per micro-step (stages 2-3)
            seq = torch.zeros(5000)
            for row in t:
                seq += row
            per_step = sum((t[a * ranks:(a + 1) * ranks].sum(0) / ranks for a in range(accum)), torch.zeros(5000))
            assert ((seq / ranks).double() - exact).abs().le(budget).all()
            assert (per_step.double() - exact).abs().le(budget).all()
        assert not (terms.sum(0).double() - exact).abs().le(budget).all()  # a missing 1/N
