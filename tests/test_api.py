"""zerofunc.initialize: DeepSpeed's four lines train any nn.Module exactly like one device."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerofunc
from tests.bare import in_world
from tests.steps import check_steps, record_step
from zerofunc.stages import STAGES


class ResidualMLP(nn.Module):
    """Not a GPT: odd widths, a ModuleList of blocks, a loss computed in forward."""

    def __init__(self, d_in: int = 7, width: int = 13, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.mse_loss(self.out(h).squeeze(-1), y)


OPTIM = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.1}}


def four_lines(stage: int, accum: int):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ResidualMLP()
    reference = copy.deepcopy(model)
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum,
                                         "zero_optimization": {"stage": stage}, "optimizer": OPTIM})
    rank, world = engine.comm.rank, engine.comm.world_size
    units = [u.name for u in engine.units]
    released = all(p.device.type == "meta" for p in model.parameters())
    initial = engine.full_parameters()
    same_start = all(torch.equal(initial[n], p.detach()) for n, p in reference.named_parameters())
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):
        x, y = torch.randn(2 * world * accum, 7, generator=gen), torch.randn(2 * world * accum, generator=gen)
        everyone = [(x[i * 2:(i + 1) * 2], y[i * 2:(i + 1) * 2]) for i in range(world * accum)]
        steps.append(record_step(engine, everyone[rank::world], everyone))  # micro-step j of rank r: j*N + r
    check_steps(reference, steps, f"stage {stage}")
    return units, released, same_start


def every_stage(accum: int) -> list:
    return [four_lines(stage, accum) for stage in STAGES]


@pytest.fixture(scope="module")
def four_lines_world() -> list[list]:
    """One 2-gloo-rank world trains every stage (a world per stage cost its start-up each): per rank, per stage,
    four_lines' results."""
    return in_world(2, every_stage, 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_trains_any_module_like_one_device(four_lines_world, stage):
    """2 gloo ranks, 2 micro-steps per step, DeepSpeed's calls: the module's own weights are released and
    are where training starts, and each of 3 steps is one device's within fp32 rounding (tests/steps.py)."""
    for units, released, same_start in (per_stage[stage] for per_stage in four_lines_world):
        assert units == ["", "blocks.0", "blocks.1", "blocks.2"]
        assert released  # the module's own weights are gone; the engine's shards hold them
        assert same_start


def test_initialize_rejects_a_bad_config():
    with pytest.raises(zerofunc.ConfigError, match="unknown config key 'zero_optimisation'"):
        zerofunc.initialize(ResidualMLP(), {"train_batch_size": 1, "zero_optimisation": {"stage": 2}})
