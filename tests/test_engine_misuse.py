"""What a user of the engine can get wrong fails loudly, and a forward that raises leaves nothing behind."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerofunc
from tests.bare import in_world

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


class Blocks(nn.Module):
    """Three blocks; the second raises while `fail` is set (a bad batch, an out-of-memory error)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 11)
        self.blocks = nn.ModuleList(nn.Linear(11, 11) for _ in range(3))
        self.fail = False

    def forward(self, x, y):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i == 1 and self.fail:
                raise ValueError("a bad batch")
            h = h + torch.tanh(block(h))
        return F.mse_loss(h.sum(-1), y)


def engine_for(stage: int):
    torch.manual_seed(0)  # the same weights on every rank
    model = Blocks()
    # stage 3 with activation checkpointing: its blocks' forwards are the engine's while it runs
    checkpointing = {"activation_checkpointing": {"mode": "full"}} if stage == 3 else {}
    return model, zerofunc.initialize(model, {**CONFIG, "zero_optimization": {"stage": stage}, **checkpointing})


def engines_marks(model: nn.Module) -> list[str]:
    """The modules that carry a hook or a forward of their own (the engine's, left behind)."""
    return [name for name, m in model.named_modules()
            if m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__]


def misuse(stage: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 5, generator=gen), torch.randn(2, generator=gen)) for _ in range(2)]
    found = {}
    model, engine = engine_for(stage)
    with pytest.raises(RuntimeError) as e:
        engine(*batches[0]).backward()
    found["loss.backward"] = str(e.value)
    model, engine = engine_for(stage)
    with pytest.raises(RuntimeError) as e:
        engine.step()
    found["step first"] = str(e.value)
    engine.backward(engine(*batches[0]))
    engine.step()
    with pytest.raises(RuntimeError) as e:
        engine.step()
    found["step twice"] = str(e.value)

    # A forward that raises halfway, then training goes on: as if it had never been tried.
    model, engine = engine_for(stage)
    _, clean = engine_for(stage)
    model.fail = True
    with pytest.raises(ValueError, match="a bad batch"):
        engine(*batches[0])
    model.fail = False
    found["bound after"] = [name for name, p in model.named_parameters() if p.device.type != "meta"]
    found["gathered after"] = [u.name for u in engine.units if stage == 3 and u.gathered]
    found["marks after"] = engines_marks(model)
    for x, y in batches:
        for e in (engine, clean):
            e.backward(e(x, y))
            found["marks after"] += engines_marks(model)  # between forward and backward as well
            e.step()
    found["marks after"] += engines_marks(model)
    ours, theirs = engine.full_parameters(), clean.full_parameters()
    found["same training"] = all(torch.equal(ours[n], theirs[n]) for n in theirs)
    return found


def both_stages() -> dict:
    return {stage: misuse(stage) for stage in (0, 3)}


@pytest.fixture(scope="module")
def misuse_world() -> list[dict]:
    """One 2-gloo-rank world for both stages: per rank, {stage: what misuse found}."""
    return in_world(2, both_stages)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", [0, 3])
def test_misuse_fails_loudly_and_a_failed_forward_leaves_no_trace(request, ranks, stage):
    """2 gloo ranks, and one. loss.backward() instead of engine.backward(loss) is an error at
    once (it used to train nothing, silently: step() returned False forever); so is step() with no backward
    since the last one. A forward that raises in the second block leaves no block bound and (stage 3) nothing
    gathered, and the steps after it equal those of an engine that never failed, bit for bit. Between the
    engine's calls, a failed one included, the caller's modules carry none of the engine's hooks or forwards
    (stage 3 with activation checkpointing, whose blocks run a checkpointed forward while the engine's runs)."""
    if ranks == 1:
        results = in_world(1, misuse, stage)
    else:
        results = [per_rank[stage] for per_rank in request.getfixturevalue("misuse_world")]
    for found in results:
        assert found["loss.backward"] == ("backward ran outside the engine: call engine.backward(loss), "
                                          "not loss.backward()")
        assert found["step first"] == found["step twice"] == \
            "step() with no engine.backward(loss) since the last step: nothing to update"
        assert found["bound after"] == [] and found["gathered after"] == []
        assert found["marks after"] == []
        assert found["same training"]
