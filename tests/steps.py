"""Training like one device, step by step, for any nn.Module whose forward returns its loss (a
tensor, or a Hugging Face output with `.loss`).

An engine's optimizer steps are recorded with the whole state before each (weights, AdamW's
moments), the reduced gradient it took and the weights after it. Each step is then held
against one device at the same weights, within the budgets tests/rounding.py derives:

- the reduced gradient, against the exact mean of the per-micro-batch gradients one device
  computes (bit for bit the engine's local gradients: the same ops on the same values),
  within what summing those terms in another order may change;
- the update and the moments it keeps, against exact (fp64) AdamW from the engine's weights and
  reduced gradient, within what an fp32 AdamW may change; the moments it starts from, the step
  count and the learning rate not taken from the engine but carried from one device's previous
  step: zero moments and step 1 on a fresh engine, then each step's exact moments, the count
  one more, and the configured schedule's rate at that count;
- the loss train_step logs, against the exact mean of one device's micro-batch losses.

The loss is the global batch's token mean (zerofunc/step.py): one device counts the targets of
the whole global batch itself, by Hugging Face's rule (labels shifted by one; -100 not counted),
and gives each micro-batch's summed loss that count / (N * grad_accum) as `num_items_in_batch`,
the value the engine must pass for the same ops to run on the same values. The exact mean of the
micro-batch terms is then (sum of every counted token's loss) / (global count), the one-device
global-batch loss and gradient, up to the one rounding of that normalizer (a factor within
gamma(3) of 1 on the whole step, the same on every term). A model whose forward takes no
`num_items_in_batch` keeps its own loss, on both sides.

A budget per step, not one tolerance over a run: AdamW divides by sqrt(v) + eps, so where a
gradient nearly cancels it turns summation-order rounding into an lr-sized step. Two correct
fp32 runs that sum in different orders then drift apart by far more than their gradients
differ (issue 22: a bias of norm 6e-4 ended 7.4e-9, 1.26e-5 of its norm, away from one
device after 3 steps on 3 ranks), so a tolerance over a whole run is either too loose to
catch a bug or too tight for a correct run. Needs only torch (no hypothesis).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.rounding import adamw_exact, clip_factor, clip_factor_error, reduction_budget
from zerofunc.optim import AdamWConfig
from zerofunc.step import loss_of, train_step


@dataclass
class Step:
    """One optimizer step of an engine, as every rank sees it."""

    number: int                       # the optimizer's step count after it (bias correction)
    params: dict[str, torch.Tensor]   # before the step
    m: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]    # reduced, before clipping
    after: dict[str, torch.Tensor]
    m_after: dict[str, torch.Tensor]
    v_after: dict[str, torch.Tensor]
    everyone: list                    # every rank's micro-batches of the step, N x grad_accum of them
    grad_accum: int
    optim: AdamWConfig
    lr_at: Callable[[int], float]     # the configured learning rate at an optimizer step (from 1)
    clip: float
    norm_terms: int                   # how many squares the engine's gradient norm sums
    loss: float                       # what train_step returned: the global batch's loss


def loss(model, batch, num_items: torch.Tensor | None = None) -> torch.Tensor:
    """The model's loss on a micro-batch: its positional arguments (a tuple) or keyword ones (a dict),
    with `num_items_in_batch` when given."""
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    return loss_of(model(**batch, **extra) if isinstance(batch, dict) else model(*batch, **extra))


def record_step(engine, mine: list, everyone: list) -> Step:
    """One optimizer step of `engine` through `train_step` (as the trainer runs it) over this rank's
    micro-batches `mine`, recorded; `everyone` is the step's micro-batches of all ranks."""
    params, (m, v) = engine.full_parameters(), engine.full_moments()
    grads, taken, update = {}, [], engine.update

    def intercepted(state, lr=None):  # the step's update at the boundary: the reduced gradients first
        grads.update(engine.full_gradients())
        after = update(state, lr)
        taken.append(after.steps > state.steps)
        return after

    engine.update = intercepted
    try:
        logged = train_step(engine, mine).item()
    finally:
        del engine.update
    assert taken == [True], ("the engine skipped the step: its gradients were not finite" if taken == [False]
                             else f"the engine was asked to step {len(taken)} times, not once")
    terms = sum(u.layout.padded_numel for u in engine.units) + len(engine.units) + engine.comm.world_size
    opt = engine.optimizer
    # the rate the user configured, by the config's own schedule (an engine built without a config: its optimizer's)
    lr_at = engine.config.lr if hasattr(engine, "config") else lambda step, lr=engine.optim.lr: lr
    return Step(engine.state.steps, params, m, v, grads, engine.full_parameters(), *engine.full_moments(), list(everyone),
                engine.grad_accum, engine.optim, lr_at, opt.clip, terms, logged)


def recorded_steps(engine, draw: Callable, steps: int, seed: int, micro_batch: int = 2) -> list[Step]:
    """`steps` recorded optimizer steps of `engine` on global batches of `micro_batch` rows per micro-step of
    each data-parallel rank, `draw(rows, generator)` giving their (inputs, targets), drawn alike on every rank:
    micro-step j of rank r takes micro-batch j * N + r."""
    world, rank = engine.data_parallel_size, dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = draw(micro_batch * world * engine.grad_accum, gen)
        everyone = [(x[i:i + micro_batch], y[i:i + micro_batch]) for i in range(0, len(x), micro_batch)]
        out.append(record_step(engine, everyone[rank::world], everyone))
    return out


def ignore_some(targets: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Targets as fine-tuning data has them: each row's first 0..T targets ignored (-100, a masked
    prompt) and 0..(the rest) of its last (padding), drawn from `gen`, so rows, micro-batches and ranks
    count different numbers of targets, some none. The last target of one row always counts (a step
    whose only counted targets sat at position 0 would give attention's queries and keys no gradient)."""
    rows, T = targets.shape
    prompt = torch.randint(0, T + 1, (rows,), generator=gen)
    pad = (torch.rand(rows, generator=gen, dtype=torch.float64) * (T + 1 - prompt)).long()  # 0..T - prompt
    pos = torch.arange(T)
    ignored = (pos < prompt[:, None]) | (pos >= T - pad[:, None])
    ignored[torch.randint(0, rows, (), generator=gen), -1] = False
    return targets.masked_fill(ignored, -100)


def drawn_steps(engine, vocab: int, seq: int, seed: int, steps: int = 2, micro_batch: int = 2) -> list[Step]:
    """`steps` recorded optimizer steps of `engine` on random tokens with ignored targets (ignore_some),
    drawn alike on every rank: a global batch holds `micro_batch` rows for each micro-step of each
    data-parallel rank, and micro-step j of rank r takes micro-batch j * N + r."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = torch.randint(0, vocab, (micro_batch * world * engine.grad_accum, seq + 1), generator=gen)
        targets = ignore_some(rows[:, 1:], gen)
        everyone = [(rows[i:i + micro_batch, :-1], targets[i:i + micro_batch])
                    for i in range(0, len(rows), micro_batch)]
        out.append(record_step(engine, everyone[rank::world], everyone))
    return out


def agreed_max(x: float) -> float:
    """The largest `x` over all ranks, the same on every rank (all pass or fail together)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def counted(batch) -> int:
    """The targets of a micro-batch a causal LM's loss counts: those not -100, of our models' targets
    as given, of Hugging Face's labels after their shift by one."""
    targets = batch["labels"][..., 1:] if isinstance(batch, dict) else batch[1]
    return int((targets != -100).sum())


def normalizer(reference: nn.Module, step: Step) -> torch.Tensor | None:
    """What one device divides each micro-batch's summed loss by: the global batch's count (at least 1)
    / (N * grad_accum), in fp32; None for a model whose forward takes no `num_items_in_batch`."""
    params = inspect.signature(reference.forward).parameters.values()
    if not any(p.name == "num_items_in_batch" or p.kind is p.VAR_KEYWORD for p in params):
        return None
    count = sum(counted(batch) for batch in step.everyone)
    return torch.tensor(float(max(count, 1)), dtype=torch.float32) / len(step.everyone)


def one_device_gradients(reference: nn.Module, step: Step):
    """At the weights the engine had before `step`, one device's fp32 gradient of each micro-batch's
    loss / grad_accum (as the engine backpropagates it); their exact sum / N and sum of |.| / N; and
    the micro-batch losses' exact sum / (N * grad_accum) and sum of |.| / (N * grad_accum).

    The ranks share the work: rank r computes micro-batches r, r + R, ... and the fp64 sums are
    all-reduced, so every rank holds the same result for 1/R of the reference's cost. Summing partial
    fp64 sums in another order moves them by fp64 rounding (2^-53 relative), far inside the fp32
    budgets they are compared under; each loss comes from one rank, exactly."""
    world = len(step.everyone) // step.grad_accum
    ranks, me = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(step.params[name])
    trained = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]  # a frozen one gets none
    mean = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in trained}
    abs_mean = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in trained}
    losses = torch.zeros(len(step.everyone), dtype=torch.float64)
    scale = 1.0 / step.grad_accum
    num_items = normalizer(reference, step)
    for i, batch in enumerate(step.everyone):
        if i % ranks != me:
            continue
        reference.zero_grad(set_to_none=True)
        value = loss(reference, batch, num_items)
        (value * scale if scale != 1.0 else value).backward()
        for n, p in trained:  # one the forward did not use has no gradient: zero, as DeepSpeed's unused parameters
            if p.grad is not None:
                mean[n] += p.grad.double() / world
                abs_mean[n] += p.grad.double().abs() / world
        losses[i] = value.item()
    if ranks > 1:
        parts = [*mean.values(), *abs_mean.values(), losses]
        flat = torch.cat([t.reshape(-1) for t in parts])
        dist.all_reduce(flat)
        for t, summed in zip(parts, flat.split([t.numel() for t in parts])):
            t.copy_(summed.view_as(t))
    values = losses.tolist()  # fsum: the exact sum, then one fp64 rounding
    return mean, abs_mean, math.fsum(values) / len(values), math.fsum(map(abs, values)) / len(values)


def ratio(diff: torch.Tensor, budget: torch.Tensor) -> float:
    """The largest diff / budget (0 where both are 0, inf where only the budget is)."""
    return (diff / budget).nan_to_num(nan=0.0).max().item() if diff.numel() else 0.0


@dataclass
class Before:
    """The optimizer state one device has before a run of steps: a fresh one's by default."""

    number: int = 0                                 # optimizer steps taken
    m: Optional[dict[str, torch.Tensor]] = None     # None: zeros
    v: Optional[dict[str, torch.Tensor]] = None


def _check_carried(step: Step, name: str, carried: dict, budget: dict | None, what: str) -> float:
    """The engine's moment `name` before `step` against the one carried: exactly (`budget` None: a fresh
    engine's zeros, a checkpoint's), or within the budget of the last step's exact result."""
    mine = getattr(step, name)
    if budget is None:
        same = all(torch.equal(mine[n], carried[n].to(mine[n].dtype)) for n in mine)
        assert agreed_max(0.0 if same else 1.0) == 0.0, \
            f"{what}, step {step.number}: the engine's {name} before the step is not the state it started from"
        return 0.0
    worst = {n: ratio((mine[n].double() - carried[n]).abs(), budget[n]) for n in mine}
    n = max(worst, key=worst.get)
    r = agreed_max(worst[n])
    assert r <= 1.0, (f"{what}, step {step.number}: the engine's {name} before the step is {r:.3g} x its rounding "
                      f"budget away from what the last step should have kept (worst here: {n} {worst[n]:.3g})")
    return r


def check_steps(reference: nn.Module, steps: list[Step], what: str, before: Before = Before()) -> float:
    """Every step's gradient, update and moments within their rounding budgets, from the state one device
    carries (`before` the first step; each step's exact results after); the verdicts agreed over ranks.
    `reference` is the plain module (any weights: each step loads the engine's). Returns the largest
    fraction of a budget used."""
    used, number = 0.0, before.number
    zeros = {n: torch.zeros_like(t) for n, t in steps[0].m.items()} if steps else {}
    carried = {"m": (before.m if before.m is not None else zeros, None),  # (moment, budget): None, exactly
               "v": (before.v if before.v is not None else zeros, None)}
    for step in steps:
        number += 1
        assert step.number == number, (f"{what}: the optimizer's step count after step {number} is {step.number}"
                                       " (bias correction and the schedule read it)")
        for name, (moment, budget) in carried.items():
            used = max(used, _check_carried(step, name, moment, budget, what))
        mean, abs_mean, loss_mean, loss_abs_mean = one_device_gradients(reference, step)
        terms = len(step.everyone)
        # the logged loss: every rank's micro-step losses summed, / grad_accum, averaged over ranks
        l_ratio = agreed_max(ratio(torch.tensor(abs(step.loss - loss_mean), dtype=torch.float64),
                                   reduction_budget(torch.tensor(loss_abs_mean, dtype=torch.float64), terms)))
        assert l_ratio <= 1.0, (f"{what}, step {step.number}: the logged loss {step.loss!r} is {l_ratio:.3g} x its "
                                f"rounding budget away from one device's global-batch loss {loss_mean!r}")
        worst = {n: ratio((step.grads[n].double() - mean[n]).abs(), reduction_budget(abs_mean[n], terms)) for n in mean}
        name = max(worst, key=worst.get)
        g_ratio = agreed_max(worst[name])
        assert g_ratio <= 1.0, (f"{what}, step {step.number}: the reduced gradient is {g_ratio:.3g} x its rounding "
                                f"budget away from one device's (worst here: {name} {worst[name]:.3g})")
        norm = torch.sqrt(sum(g.double().square().sum() for g in step.grads.values())).item()
        factor = clip_factor(norm, step.clip)
        factor_error = clip_factor_error(step.norm_terms, 0, 0) if step.clip else 0.0
        o = step.optim
        exact = {n: adamw_exact(step.params[n], step.grads[n], step.m[n], step.v[n], number, step.lr_at(number),
                                o.betas, o.eps, o.weight_decay, factor, factor_error) for n in step.grads}
        moved = [n for n in step.params if n not in step.grads and not torch.equal(step.after[n], step.params[n])]
        assert agreed_max(float(bool(moved))) == 0.0, \
            f"{what}, step {step.number}: frozen parameter(s) changed: {', '.join(moved[:3]) or 'on another rank'}"
        for kept, got in (("p", step.after), ("m", step.m_after), ("v", step.v_after)):
            worst = {n: ratio((got[n].double() - getattr(e, kept)).abs(), getattr(e, f"{kept}_budget"))
                     for n, e in exact.items()}
            name = max(worst, key=worst.get)
            p_ratio = agreed_max(worst[name])
            assert p_ratio <= 1.0, (f"{what}, step {step.number}: the {'update' if kept == 'p' else kept + ' it keeps'} "
                                    f"is {p_ratio:.3g} x its rounding budget away from exact AdamW at step {number}, "
                                    f"lr {step.lr_at(number):.6g} (worst here: {name} {worst[name]:.3g})")
            used = max(used, p_ratio)
        carried = {k: ({n: getattr(e, k) for n, e in exact.items()}, {n: getattr(e, f"{k}_budget") for n, e in exact.items()})
                   for k in ("m", "v")}
        used = max(used, g_ratio, l_ratio)
    return used
