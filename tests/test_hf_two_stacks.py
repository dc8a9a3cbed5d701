"""Hugging Face models of two stacks of blocks (an encoder's and a decoder's, a text tower's and a vision
tower's) through zerofunc.initialize: stage 3 gathers the blocks of both, and an encoder-decoder's loss is the
one its model defines, over the global batch (its labels counted as its loss counts them). Runs where
transformers is installed (the test extras install it)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.bare import in_world
from tests.hf_families import TWO_STACKS
from tests.rounding import reduction_budget
from zerofunc.api import default_units

transformers = pytest.importorskip("transformers")

OPTIM = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.1}}
STEPS = 3


@pytest.mark.parametrize("family", TWO_STACKS)
def test_every_stack_of_blocks_is_a_unit(family):
    """Each block of both stacks is a unit, gathered alone at stage 3, in the modules' order (the encoder's
    first: the order the first step prefetches in). Left in the root unit, the smaller stack's blocks would
    stay gathered all step: half an encoder-decoder's weights."""
    build, stacks = TWO_STACKS[family]
    model = build()
    blocks = [f"{stack}.{i}" for stack in stacks for i in range(len(model.get_submodule(stack)))]
    assert default_units(model) == blocks


def micro_batches(family: str, world: int, gen: torch.Generator) -> list[dict]:
    """A step's micro-batches, every rank's (micro-batch r is rank r's). A sequence-to-sequence model's: one row,
    its inputs (9 tokens; Whisper's 8 x 32 log-mel features) and 7 labels of which the last 0..6 are padding
    (-100), so ranks count different numbers of labels, every one at least one (T5's own mean over none would
    be NaN). CLIP's: 2 captions of 7 tokens and their 16 x 16 images, its contrastive loss asked for."""
    if family == "clip":
        return [{"input_ids": torch.randint(1, 53, (2, 7), generator=gen),
                 "pixel_values": torch.randn(2, 3, 16, 16, generator=gen), "return_loss": True} for _ in range(world)]
    ids = torch.randint(1, 53, (world, 9), generator=gen)
    labels = torch.randint(1, 53, (world, 7), generator=gen)
    pad = torch.randint(0, 7, (world,), generator=gen)
    labels = labels.masked_fill(torch.arange(7) >= 7 - pad[:, None], -100)
    if family == "whisper":
        features = torch.randn(world, 8, 32, generator=gen)
        return [{"input_features": features[r:r + 1], "labels": labels[r:r + 1]} for r in range(world)]
    return [{"input_ids": ids[r:r + 1], "labels": labels[r:r + 1]} for r in range(world)]


def one_device_loss(model, everyone: list[dict], family: str) -> tuple[float, float]:
    """The global batch's loss as the model defines it, on one device: T5's and Whisper's, their own mean over
    each micro-batch's labels (CrossEntropyLoss's, modeling_t5.py; they ignore num_items_in_batch), CLIP's its
    contrastive loss over each micro-batch's pairs, averaged over the micro-batches; T5Gemma's, its loss summed
    over the global batch's labels / their count, every label counted (its decoder reads the labels shifted
    right: each one is a target), which it computes from the num_items_in_batch it is given. (the loss, the mean
    of its terms' absolute values), the sums exact."""
    with torch.no_grad():
        if family == "t5gemma":
            count = sum(int((b["labels"] != -100).sum()) for b in everyone)
            num_items = torch.tensor(float(count)) / len(everyone)
            terms = [model(**b, num_items_in_batch=num_items).loss.item() for b in everyone]
        else:
            terms = [model(**b).loss.item() for b in everyone]
    return math.fsum(terms) / len(terms), math.fsum(map(abs, terms)) / len(terms)


RUNS = [(0, False), (3, False), (3, True)]  # (stage, the model's own gradient checkpointing on)
TRAINED = ("t5", "t5gemma", "whisper", "clip")


def _runs(family: str) -> list:
    import zerofunc
    out = []
    for stage, checkpointed in RUNS:
        torch.manual_seed(0)
        model = TWO_STACKS[family][0]()
        reference = copy.deepcopy(model) if not out else None  # the first run's: one device's loss, once
        if checkpointed:
            model.gradient_checkpointing_enable()
        engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 1, "optimizer": OPTIM,
                                             "zero_optimization": {"stage": stage}})
        rank, world = engine.comm.rank, engine.comm.world_size
        gen, losses = torch.Generator().manual_seed(1), []
        for i in range(STEPS):
            everyone = micro_batches(family, world, gen)
            if i == 0 and reference is not None:
                expected = one_device_loss(reference, everyone, family)
            losses.append(zerofunc.train_step(engine, everyone[rank:rank + 1]).item())
        out.append((losses, engine.full_parameters()))
    (losses0, params0), *others = out
    return losses0, expected, [(losses, all(torch.equal(params0[n], p[n]) for n in params0)) for losses, p in others]


def _every_family() -> dict:
    return {family: _runs(family) for family in TRAINED}


@pytest.mark.slow
def test_two_stack_models_train_at_stage_3_as_at_stage_0_with_their_own_loss():
    """T5, T5Gemma, Whisper and CLIP on 2 gloo ranks, one micro-batch a step, 3 steps. Stage 3 (every block of
    both stacks gathered at its run, a decoder's reading the encoder's output across units) gives stage 0's losses and
    weights bit for bit, with the model's own gradient checkpointing on too (the engine recomputes each block:
    the same ops on the same values): each rank computes the same ops on the same values at both stages, each
    reduction adds two terms (a + b = b + a in fp32), and AdamW works element by element. The first step's logged
    loss is one device's global-batch loss as the model defines it (`one_device_loss`), within the one fp32
    addition and halving that averaging two ranks' losses rounds (tests/rounding.py)."""
    for per_rank in in_world(2, _every_family):
        for family, (losses0, (expected, abs_mean), others) in per_rank.items():
            for (stage, checkpointed), (losses, same_weights) in zip(RUNS[1:], others):
                what = f"{family}, stage {stage}{', checkpointed by the model' if checkpointed else ''}"
                assert losses == losses0, f"{what}: losses {losses} are not stage 0's {losses0}"
                assert same_weights, f"{what}: the weights after {STEPS} steps are not stage 0's"
            budget = reduction_budget(torch.tensor(abs_mean, dtype=torch.float64), 2).item()
            assert abs(losses0[0] - expected) <= budget, (f"{family}: the first step's loss {losses0[0]!r} is not one "
                                                         f"device's {expected!r} (within {budget:.2g})")

