"""Shared helpers for the property-based tests that run on real multi-process gloo groups (hypothesis).

A world is started once per test and runs many cases; hypothesis with
`derandomize=True`, no example database and no shrinking draws the same cases on
every rank.
Each rank computes the same single-process reference itself, and every verdict is
agreed over the group (max of the ranks' errors), so all ranks pass or fail
together instead of deadlocking on a collective one rank never reaches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, settings, strategies as st

from zerofunc.models import GPT, GPTConfig

# No shrinking: every shrink step re-runs a case on all ranks, which made one failing
# run take minutes; the drawn cases are small enough to read unshrunk.
IN_RANK = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                   suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])


def agreed_max(x: float) -> float:
    """The largest `x` over all ranks, the same on every rank."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


@dataclass(frozen=True)
class Case:
    cfg: GPTConfig
    seed: int
    micro_batch: int
    seq: int


@st.composite
def small_cases(draw) -> Case:
    """Small GPTs of odd widths that rarely divide the world size, 1-3 blocks.

    Widths start at 3: a LayerNorm over 1 or 2 features has a constant or +-1 output,
    so no gradient flows through it and "gradients are nonzero" could not hold.
    """
    n_head = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([3, 5, 7]))
    seq = draw(st.integers(2, 9))
    cfg = GPTConfig(n_layer=draw(st.integers(1, 3)), n_head=n_head, n_embd=n_head * head_dim,
                    vocab_size=draw(st.integers(5, 41)), block_size=seq + draw(st.integers(0, 3)),
                    dropout=draw(st.sampled_from([0.0, 0.25])))
    return Case(cfg, seed=draw(st.integers(0, 2**16)), micro_batch=draw(st.integers(1, 3)), seq=seq)


def reference_model(case: Case) -> GPT:
    """The plain single-device model with the same initial weights the engine starts from."""
    model = GPT(case.cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(model.init_param(name, tuple(p.shape), case.seed))
    return model


def global_batches(case: Case, world_size: int, steps: int):
    """Per step (inputs, targets, sample ids) of the whole global batch."""
    gen = torch.Generator().manual_seed(case.seed)
    size = case.micro_batch * world_size
    rows = [torch.randint(0, case.cfg.vocab_size, (size, case.seq + 1), generator=gen) for _ in range(steps)]
    return [(r[:, :-1], r[:, 1:], torch.arange(size) + step * size) for step, r in enumerate(rows)]
