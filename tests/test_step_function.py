"""The step is a function (zerofunc/step.py): its state goes in and comes out, frozen, and nothing of the
engine but the units' buffers (donated) changes across a step."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.bare import OPTIM, in_world
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPT, GPTConfig
from zerofunc.stages import STAGES
from zerofunc.state import OptimizerState
from zerofunc.step import step

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=30, block_size=12)


def _plain(obj) -> dict:
    """An object's attributes that are values, not buffers: numbers, strings, None, frozen dataclasses."""
    return {k: v for k, v in vars(obj).items()
            if isinstance(v, (int, float, bool, str, type(None))) or dataclasses.is_dataclass(v)}


def _engine(stage: int) -> ZeroEngine:
    with torch.device("meta"):
        model = GPT(CFG)
    return ZeroEngine(model, STAGES[stage], DistCommunicator(), OPTIM, init=lambda n, s: model.init_param(n, s, 0),
                      grad_accum=2, clip=0.5)


def _steps(stage: int) -> dict:
    g = torch.Generator().manual_seed(dist_rank())
    batches = [[[torch.randint(0, CFG.vocab_size, (2, 9), generator=g) for _ in range(2)] for _ in range(2)]
               for _ in range(2)]
    engine = _engine(stage)
    own_state = engine.state
    parts = (engine, engine.optimizer, engine.reduction, engine.gathering)
    before = [_plain(p) for p in parts]
    start = OptimizerState(steps=4)  # as after four steps: the bias correction's t comes from here
    state, metrics = step(engine, start, batches[0])
    state, metrics = step(engine, state, batches[1])
    out = {"unchanged": [_plain(p) == b for p, b in zip(parts, before)],
           "engine_state_untouched": engine.state is own_state, "start": start == OptimizerState(steps=4),
           "steps": state.steps,
           "norm": metrics.grad_norm == state.grad_norm and metrics.applied}
    # the same two steps through the imperative API, its state started at the same t: the same weights
    twin = _engine(stage)
    twin.state = OptimizerState(steps=4)
    for micro in batches:
        for b in micro:
            twin.backward(twin(*b))
        twin.step()
    ours, theirs = engine.full_parameters(), twin.full_parameters()
    out["same_as_imperative"] = all(torch.equal(ours[n], theirs[n]) for n in ours)
    return out


def dist_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def _every_stage() -> dict:
    return {stage: _steps(stage) for stage in STAGES}


@pytest.mark.parametrize("world", [2])
def test_the_step_takes_its_state_and_gives_it_back(world):
    """2 gloo ranks, stages 0-3, two steps of two micro-batches: `step(engine, state, batches)` returns the
    state after it (t counted on from the state given, 4 -> 6) and leaves the given state as it was (frozen);
    the engine's, its optimizer's, its reduction's and its gathering's plain attributes are those before the
    steps (no counter of the engine's moved: the engine's own `state`, the imperative API's, is untouched);
    and the imperative API (backward, step) from an engine state at the same t gives the same weights, bit
    for bit: both run the same calls."""
    for per_stage in in_world(world, _every_stage):
        for stage, found in per_stage.items():
            assert all(found["unchanged"]), f"stage {stage}: an engine attribute changed across a step"
            assert found["engine_state_untouched"], f"stage {stage}"
            assert found["start"] and found["steps"] == 6, f"stage {stage}: {found}"
            assert found["norm"], f"stage {stage}"
            assert found["same_as_imperative"], f"stage {stage}: the functional step trained otherwise"
