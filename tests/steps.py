"""Training like one device, step by step, for any nn.Module whose forward returns its loss (a
tensor, or a Hugging Face output with `.loss`).

An engine's optimizer steps are recorded with the whole state before each (weights, AdamW's
moments), the reduced gradient it took and the weights after it. Each step is then held
against one device at the same weights, within the budgets tests/rounding.py derives:

- the reduced gradient, against the exact mean of the per-micro-batch gradients one device
  computes (bit for bit the engine's local gradients: the same ops on the same values),
  within what summing those terms in another order may change;
- the update, against exact (fp64) AdamW from the engine's own weights, moments and reduced
  gradient, within what an fp32 AdamW may change.

A budget per step, not one tolerance over a run: AdamW divides by sqrt(v) + eps, so where a
gradient nearly cancels it turns summation-order rounding into an lr-sized step. Two correct
fp32 runs that sum in different orders then drift apart by far more than their gradients
differ (issue 22: a bias of norm 6e-4 ended 7.4e-9, 1.26e-5 of its norm, away from one
device after 3 steps on 3 ranks), so a tolerance over a whole run is either too loose to
catch a bug or too tight for a correct run. Needs only torch (no hypothesis).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.rounding import adamw_exact_and_budget, clip_factor, clip_factor_error, reduction_budget
from zerofunc.optim import AdamWConfig
from zerofunc.step import loss_of


@dataclass
class Step:
    """One optimizer step of an engine, as every rank sees it."""

    number: int                       # the optimizer's step count after it (bias correction)
    params: dict[str, torch.Tensor]   # before the step
    m: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]    # reduced, before clipping
    after: dict[str, torch.Tensor]
    everyone: list                    # every rank's micro-batches of the step, N x grad_accum of them
    grad_accum: int
    optim: AdamWConfig
    lr: float                         # the step's learning rate (a schedule's, if the engine has one)
    clip: float
    norm_terms: int                   # how many squares the engine's gradient norm sums


def loss(model, batch) -> torch.Tensor:
    """The model's loss on a micro-batch: its positional arguments (a tuple) or keyword ones (a dict)."""
    return loss_of(model(**batch) if isinstance(batch, dict) else model(*batch))


def record_step(engine, mine: list, everyone: list) -> Step:
    """One optimizer step of `engine` over this rank's micro-batches `mine`, recorded; `everyone` is
    the step's micro-batches of all ranks."""
    params, (m, v) = engine.full_parameters(), engine.full_moments()
    for i, batch in enumerate(mine):
        engine.backward(loss(engine, batch))
        if i + 1 < len(mine):  # as DeepSpeed's users call it: step() after every micro-step, a no-op before the last
            assert not engine.step(), "the engine stepped before the accumulation boundary"
    grads = engine.full_gradients()
    assert engine.step(), "the engine skipped the step"
    terms = sum(u.layout.padded_numel for u in engine.units) + len(engine.units) + engine.comm.world_size
    opt = engine.optimizer
    lr = opt.lr_schedule(opt.step_count) if opt.lr_schedule is not None else engine.optim.lr
    return Step(opt.step_count, params, m, v, grads, engine.full_parameters(), list(everyone),
                engine.grad_accum, engine.optim, lr, opt.clip, terms)


def agreed_max(x: float) -> float:
    """The largest `x` over all ranks, the same on every rank (all pass or fail together)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def one_device_gradients(reference: nn.Module, step: Step):
    """At the weights the engine had before `step`, one device's fp32 gradient of each micro-batch's
    loss / grad_accum (as the engine backpropagates it); their exact sum / N and sum of |.| / N."""
    world = len(step.everyone) // step.grad_accum
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(step.params[name])
    mean = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in reference.named_parameters()}
    abs_mean = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in reference.named_parameters()}
    scale = 1.0 / step.grad_accum
    for batch in step.everyone:
        reference.zero_grad(set_to_none=True)
        value = loss(reference, batch)
        (value * scale if scale != 1.0 else value).backward()
        for n, p in reference.named_parameters():
            mean[n] += p.grad.double() / world
            abs_mean[n] += p.grad.double().abs() / world
    return mean, abs_mean


def ratio(diff: torch.Tensor, budget: torch.Tensor) -> float:
    """The largest diff / budget (0 where both are 0, inf where only the budget is)."""
    return (diff / budget).nan_to_num(nan=0.0).max().item() if diff.numel() else 0.0


def check_steps(reference: nn.Module, steps: list[Step], what: str) -> float:
    """Every step's gradient and update within their rounding budgets; the verdicts agreed over ranks.
    `reference` is the plain module (any weights: each step loads the engine's). Returns the largest
    fraction of a budget used."""
    used = 0.0
    for step in steps:
        mean, abs_mean = one_device_gradients(reference, step)
        terms = len(step.everyone)
        worst = {n: ratio((step.grads[n].double() - mean[n]).abs(), reduction_budget(abs_mean[n], terms)) for n in mean}
        name = max(worst, key=worst.get)
        g_ratio = agreed_max(worst[name])
        assert g_ratio <= 1.0, (f"{what}, step {step.number}: the reduced gradient is {g_ratio:.3g} x its rounding "
                                f"budget away from one device's (worst here: {name} {worst[name]:.3g})")
        norm = torch.sqrt(sum(g.double().square().sum() for g in step.grads.values())).item()
        factor = clip_factor(norm, step.clip)
        factor_error = clip_factor_error(step.norm_terms, 0, 0) if step.clip else 0.0
        o = step.optim
        worst = {}
        for n in step.params:
            exact, budget = adamw_exact_and_budget(step.params[n], step.grads[n], step.m[n], step.v[n], step.number,
                                                   step.lr, o.betas, o.eps, o.weight_decay, factor, factor_error)
            worst[n] = ratio((step.after[n].double() - exact).abs(), budget)
        name = max(worst, key=worst.get)
        p_ratio = agreed_max(worst[name])
        assert p_ratio <= 1.0, (f"{what}, step {step.number}: the update is {p_ratio:.3g} x its rounding budget away "
                                f"from exact AdamW on the engine's own state (worst here: {name} {worst[name]:.3g})")
        used = max(used, g_ratio, p_ratio)
    return used
