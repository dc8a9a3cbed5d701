"""fp16 loss scaling: an overflow on any rank skips the step on every rank; the scale adapts."""
from __future__ import annotations

import pytest
import torch

from tests.bare import in_world
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.loss_scale import LossScaler
from zerofunc.models import GPT, model_config
from zerofunc.optim import AdamWConfig
from zerofunc.stages import STAGES


def test_scale_halves_after_hysteresis_overflows_and_doubles_after_a_clean_window():
    s = LossScaler(scale=1024.0, window=3, hysteresis=2, min_scale=256.0)
    s = s.updated(True)
    assert s.scale == 1024.0  # one overflow is tolerated
    s = s.updated(True)
    assert s.scale == 512.0
    for _ in range(2):
        s = s.updated(False)
    assert s.scale == 512.0
    s = s.updated(False)
    assert s.scale == 1024.0  # three clean steps in a row
    for _ in range(6):
        s = s.updated(True)
    assert s.scale == 256.0  # never below min_scale
    static = LossScaler(scale=128.0, dynamic=False)
    assert static.updated(True) == static


def overflow_on_one_rank(stage: int) -> list:
    comm = DistCommunicator()
    with torch.device("meta"):
        model = GPT(model_config("gpt2-tiny", n_layer=1, n_embd=24, n_head=2, vocab_size=29, block_size=8))
    scaler = LossScaler(scale=2.0**10, hysteresis=1, window=100)
    engine = ZeroEngine(model, STAGES[stage], comm, AdamWConfig(lr=1e-2), precision="fp16", loss_scaler=scaler,
                        init=lambda n, s: model.init_param(n, s, 0))
    x = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(comm.rank))
    outcome = []
    last = comm.rank == comm.world_size - 1
    for step in range(3):
        loss = engine(x[:, :-1], x[:, 1:])
        if step == 1 and last and stage == 0:
            loss = loss * float("inf")  # whole gradients: every rank sees it after the all-reduce
        before = engine.full_parameters()
        engine.backward(loss)
        if step == 1 and last and stage > 0:
            engine.units[-1].grad[0] = float("inf")  # one element of one rank's shard overflows
        stepped = engine.step()
        after = engine.full_parameters()
        changed = any(not torch.equal(before[n], after[n]) for n in before)
        finite = all(torch.isfinite(p).all() for p in after.values())
        outcome.append((stepped, changed, finite, engine.state.loss_scale.scale))
    return outcome


def every_stage() -> list[list]:
    return [overflow_on_one_rank(stage) for stage in STAGES]


@pytest.fixture(scope="module")
def overflow_world() -> list[list]:
    """One 2-gloo-rank world runs every stage (a world per stage cost its start-up each): per rank, per stage,
    overflow_on_one_rank's outcome."""
    return in_world(2, every_stage)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overflow_on_any_rank_skips_the_step_everywhere(overflow_world, stage):
    for outcome in (per_stage[stage] for per_stage in overflow_world):
        assert [o[:3] for o in outcome] == [(True, True, True), (False, False, True), (True, True, True)]
        assert [o[3] for o in outcome] == [2.0**10, 2.0**9, 2.0**9]
