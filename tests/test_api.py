"""zerofunc.initialize: DeepSpeed's four lines train any nn.Module exactly like one device; a language model's
loss is the global batch's token mean, however its ignored targets (-100) fall on ranks and micro-steps."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerofunc
from tests.bare import in_world
from tests.steps import check_steps, ignore_some, record_step
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


class TokenMLP(nn.Module):
    """A language model that is not a transformer, in Hugging Face's convention: its forward takes
    `num_items_in_batch` and returns the summed token loss divided by it (the targets' own mean without it)."""

    def __init__(self, vocab: int = 19, width: int = 11, depth: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets, num_items_in_batch=None):
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        logits, t = self.head(h).flatten(0, 1).float(), targets.flatten()
        if num_items_in_batch is None:
            return F.cross_entropy(logits, t, ignore_index=-100)
        return F.cross_entropy(logits, t, ignore_index=-100, reduction="sum") / num_items_in_batch


OPTIM = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.1}}


def batches(kind: str, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch for `kind`: features and regression targets, or tokens and next-token targets with
    ignored positions (-100) that count differently on each rank and micro-step."""
    if kind == "regression":
        return torch.randn(rows, 7, generator=gen), torch.randn(rows, generator=gen)
    tokens = torch.randint(0, 19, (rows, 6), generator=gen)
    return tokens[:, :-1], ignore_some(tokens[:, 1:], gen)


def four_lines(stage: int, accum: int, kind: str):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ResidualMLP() if kind == "regression" else TokenMLP()
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
        x, y = batches(kind, 2 * world * accum, gen)
        everyone = [(x[i * 2:(i + 1) * 2], y[i * 2:(i + 1) * 2]) for i in range(world * accum)]
        steps.append(record_step(engine, everyone[rank::world], everyone))  # micro-step j of rank r: j*N + r
    check_steps(reference, steps, f"{kind}, stage {stage}")
    return units, released, same_start


def every_stage(accum: int) -> dict[str, list]:
    return {kind: [four_lines(stage, accum, kind) for stage in STAGES] for kind in ("regression", "tokens")}


@pytest.fixture(scope="module")
def four_lines_world() -> list[dict]:
    """One 2-gloo-rank world trains every stage of both modules (a world per stage cost its start-up each):
    per rank, per module, per stage, four_lines' results."""
    return in_world(2, every_stage, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind, blocks", [("regression", 3), ("tokens", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_trains_any_module_like_one_device(four_lines_world, stage, kind, blocks):
    """2 gloo ranks, 2 micro-steps per step, DeepSpeed's calls as train_step makes them: the module's own
    weights are released and are where training starts, and each of 3 steps is one device's within fp32
    rounding (tests/steps.py). A language model that takes num_items_in_batch gets the global batch's token
    mean, a regression its micro-batches' mean."""
    for units, released, same_start in (per_rank[kind][stage] for per_rank in four_lines_world):
        assert units == ["", *(f"blocks.{i}" for i in range(blocks))]
        assert released  # the module's own weights are gone; the engine's shards hold them
        assert same_start


def test_initialize_rejects_a_bad_config():
    with pytest.raises(zerofunc.ConfigError, match="unknown config key 'zero_optimisation'"):
        zerofunc.initialize(ResidualMLP(), {"train_batch_size": 1, "zero_optimisation": {"stage": 2}})
