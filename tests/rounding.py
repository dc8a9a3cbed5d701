"""What fp32 rounding may legitimately change in one training step: budgets derived, not picked.

The model is the standard one of floating-point error analysis (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., sections 2.2 and 3.1): every basic
operation returns the exact result of its (floating-point) operands times (1 + d),
|d| <= u, with u = 2**-24 in fp32; a fused multiply-add rounds once. Then

- a sum of n floating-point numbers, in any order and any tree, is within
  gamma(n - 1) * sum|x_i| of the exact sum, where gamma(n) = n u / (1 - n u);
- k roundings of one quantity, chained, are within gamma(k) of it, relatively.

Two consequences make equivalence tests honest. First, reordering a reduction moves its
result by up to gamma(n) times the sum of the *absolute* terms, which can be far more
than the result itself when the terms cancel: a relative tolerance on such a gradient
is picked, not derived. Second, AdamW divides by sqrt(v) + eps, so where a gradient
nearly cancels the update turns a tiny absolute error into a large one; the budget
below follows that division instead of hiding it under a loose tolerance.

Every budget here bounds first-order terms; second-order terms (products of two
roundings, below 2**-48 relative) are covered by using gamma(k) rather than k u.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

U32 = 2.0 ** -24  # fp32 unit roundoff


def gamma(n: int | float) -> float:
    """gamma(n) = n u / (1 - n u): the relative error bound of n chained fp32 roundings."""
    return n * U32 / (1 - n * U32)


def reduction_budget(abs_mean: torch.Tensor, terms: int) -> torch.Tensor:
    """The most a correct engine's reduced gradient may differ from the exact mean of the same terms.

    The engine sums `terms` fp32 per-micro-batch gradients (over ranks and accumulated
    micro-steps, in whatever tree its collectives use: terms - 1 additions) and divides
    by the number of ranks once per reduction (a division, or a multiplication by a
    rounded 1/N: two roundings). Adding the zeros that stand in other ranks' slots is
    exact. `abs_mean` is sum|g_j| / N, exact in fp64.
    """
    return gamma(terms + 1) * abs_mean


def clip_factor(norm: float, clip: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient, capped at 1, from the exact norm."""
    return min(1.0, clip / (norm + 1e-6)) if clip else 1.0


def clip_factor_error(elements: int, units: int, ranks: int) -> float:
    """Relative error of the clip coefficient the engine computes in fp32.

    Its squared norm sums `elements` squares per unit, `units` unit sums and `ranks` rank
    sums, all non-negative, so the relative error is at most gamma(elements + units +
    ranks) plus the roundings of the square, of vector_norm's own sqrt and of the final
    sqrt (gamma(4)); the square root halves a relative error. The coefficient itself is
    computed in Python floats (fp64): 2 roundings of 2**-53, below one fp32 rounding.
    """
    return gamma(elements + units + ranks + 4) / 2 + gamma(2)


@dataclass
class ExactAdamW:
    """One AdamW step's exact (fp64) results, each with the most an fp32 step may be off from it."""

    p: torch.Tensor
    p_budget: torch.Tensor
    m: torch.Tensor
    m_budget: torch.Tensor
    v: torch.Tensor
    v_budget: torch.Tensor


def adamw_exact(p, g, m, v, step: int, lr: float, betas, eps: float, weight_decay: float,
                factor: float, factor_error: float) -> ExactAdamW:
    """One AdamW step of fp32 state in exact (fp64) arithmetic, and the most an fp32 update may be off.

    Inputs are the engine's fp32 tensors before its step (parameter, reduced gradient,
    moments) and the exact clip coefficient `factor` with the engine's relative error
    `factor_error` on it. The update, whatever the order or fusion of its operations
    (torch's fused CPU kernel, the 7-op reference, the Triton kernel), performs:

    - g' = g * factor: 2 roundings (torch's fused kernel divides by a rounded 1 / factor),
      plus the coefficient's own error;
    - m' = b1 m + (1 - b1) g' (a lerp): at most 3 roundings of terms bounded by |m| + |g'|;
    - v' = b2 v + (1 - b2) g'^2: all terms non-negative, at most 5 roundings (the
      constant 1 - b2, two products, b2 v, the sum) relative to v';
    - s = sqrt(v') / sqrt(1 - b2^t): sqrt, the rounded constant, the division: 3; and
      sqrt(x + e) - sqrt(x) <= min(sqrt(e), e / (2 sqrt(x))) carries v's error;
    - d = s + eps: eps rounded to fp32, the sum: 2;
    - the step (lr / (1 - b1^t)) m' / d: the rounded step size, the product, the
      division: 3, plus the errors of m' and of d carried through the quotient;
    - p' = p (1 - lr wd) - step: the rounded constant, the product, the difference: 3.

    Returns p', m' and v' exact with their budgets, all fp64, per element.
    """
    b1, b2 = betas
    p, g, m, v = (t.double() for t in (p, g, m, v))
    gs = g * factor
    m1 = b1 * m + (1 - b1) * gs
    v1 = b2 * v + (1 - b2) * gs * gs
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    s = (v1 / bc2).sqrt()
    d = s + eps
    step_size = lr / bc1
    upd = step_size * m1 / d
    p1 = p * (1 - lr * weight_decay) - upd

    e_g = (gamma(2) + factor_error) * gs.abs()
    e_m = gamma(3) * (m.abs() + gs.abs()) + (1 - b1) * e_g
    e_v = gamma(5) * v1 + (1 - b2) * (2 * gs.abs() * e_g + e_g * e_g)
    e_sqrt = torch.minimum(e_v.sqrt(), e_v / (2 * v1.sqrt()).clamp_min(1e-300))
    e_s = e_sqrt / math.sqrt(bc2) + gamma(3) * (s + e_sqrt)
    e_d = e_s + gamma(2) * d
    if bool((e_d >= d).any()):
        raise ValueError("the rounding budget of the denominator reaches the denominator: eps too small")
    e_upd = gamma(3) * upd.abs() + step_size * (e_m / (d - e_d) + m1.abs() * e_d / (d * (d - e_d)))
    e_p = gamma(3) * p.abs() + gamma(1) * (p1.abs() + upd.abs()) + e_upd
    return ExactAdamW(p1, e_p, m1, e_m, v1, e_v)
