"""Frozen parameters (requires_grad=False): a partial fine-tune through zerofunc.initialize trains like one
device that freezes the same parameters, and the frozen ones never change (issue 32).

A unit's frozen parameters are a flat buffer of their own beside its trainable ones (zerofunc/units.py,
FrozenPart): no gradient, reduction, master, moments or weight decay, and stage 3 shards and gathers them
with the rest. The models freeze three ways at once: part of the root unit (the input layer), a whole
block, and part of a block (its LayerNorm).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import zerofunc
from tests.bare import in_world
from tests.steps import check_steps, recorded_steps
from tests.modules import OPTIM, ResidualMLP, TokenMLP, batches
from zerofunc.stages import STAGES


def frozen_model(kind: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ResidualMLP() if kind == "regression" else TokenMLP()
    first = model.inp if kind == "regression" else model.emb
    for p in (*first.parameters(), *model.blocks[0].parameters(), *model.blocks[1][0].parameters()):
        p.requires_grad_(False)
    return model


def _train(stage: int, kind: str):
    model = frozen_model(kind)
    reference = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                         "gradient_clipping": 0.05, "zero_optimization": {"stage": stage},
                                         "optimizer": OPTIM})
    steps = recorded_steps(engine, lambda rows, gen: batches(kind, rows, gen), steps=3, seed=1)
    check_steps(reference, steps, f"{kind}, stage {stage}")  # frozen ones bit for bit, the rest as one device
    after = engine.full_parameters()
    kept = all(torch.equal(after[n], t) for n, t in frozen.items())
    moments = set(engine.full_moments()[0])
    return kept, moments.isdisjoint(frozen), min(s.grads and max(g.abs().max().item() for g in s.grads.values())
                                               for s in steps)


LEVERS = {  # a stage and the levers with it, on 4 ranks
    "stage 3, full activation checkpointing, optimizer offload": (3, {"offload_optimizer": {"device": "cpu"}},
                                                                  {"activation_checkpointing": {"mode": "full"}}),
    "stage 3, hpZ in pairs": (3, {"zero_hpz_partition_size": 2}, {}),
    "stage 3, hybrid sharding in groups of 2, full activation checkpointing": (
        3, {"shard_group_size": 2}, {"activation_checkpointing": {"mode": "full"}}),
}


def _train_with(what: str) -> tuple[bool, float]:
    stage, zero, top = LEVERS[what]
    model = frozen_model("tokens")
    reference = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                         "gradient_clipping": 0.05, "zero_optimization": {"stage": stage, **zero},
                                         "optimizer": OPTIM, **top})
    steps = recorded_steps(engine, lambda rows, gen: batches("tokens", rows, gen), steps=2, seed=2)
    check_steps(reference, steps, what)
    after = engine.full_parameters()
    return all(torch.equal(after[n], t) for n, t in frozen.items()), min(
        max(g.abs().max().item() for g in s.grads.values()) for s in steps), \
        {e.group for e in engine.comm.ledger if e.tag == "params.bwd"}


def every_lever():
    return {what: _train_with(what) for what in LEVERS}


@pytest.mark.slow
def test_frozen_parameters_with_every_lever():
    """4 gloo ranks, the levers of LEVERS, 2 steps of 2 micro-steps each, clipped: as the test above. Full
    activation checkpointing recomputes block 1, whose input needs no gradient (nothing before it trains):
    its Linear's weight must still get its gradient. Under hpZ, backward gathers frozen weights from the
    node's copies as it does trainable ones: every backward gather on the secondary group."""
    for per_lever in in_world(4, every_lever):
        for what, (kept, largest_grad, backward_groups) in per_lever.items():
            assert kept, f"{what}: a frozen parameter changed"
            assert largest_grad > 0, f"{what}: no gradient reached the trainable parameters"
            if "hpZ" in what:
                assert backward_groups == {"secondary"}, f"{what}: backward gathered on {backward_groups}"


KINDS = {0: "regression", 1: "tokens", 2: "regression", 3: "tokens"}  # each stage once, each module twice


def every_stage():
    return [_train(stage, KINDS[stage]) for stage in STAGES]


@pytest.mark.slow
def test_frozen_parameters_stay_and_the_rest_train_like_one_device():
    """3 gloo ranks (no unit divides by 3), stages 0-3 (a regression MLP at 0 and 2, a token model at 1 and
    3), 2 micro-steps, clipping and weight decay on: each of 3 steps within tests/steps.py's rounding budgets
    of one device whose same parameters are frozen (its gradients, AdamW and moments), the frozen parameters
    equal to the last bit after every step, and none of them with AdamW moments."""
    for per_stage in in_world(3, every_stage):
        for stage, (kept, no_moments, largest_grad) in zip(STAGES, per_stage):
            assert kept, f"stage {stage}: a frozen parameter changed"
            assert no_moments, f"stage {stage}: a frozen parameter has optimizer moments"
            assert largest_grad > 0, f"stage {stage}: no gradient reached the trainable parameters"


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def _backward_matmuls(stage: int, freeze: bool) -> int:
    model = frozen_model("regression") if freeze else ResidualMLP()
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                                         "optimizer": OPTIM})
    x, y = batches("regression", 2, torch.Generator().manual_seed(0))
    loss = engine(x, y)
    counting = _CountMatmuls()
    with counting:
        engine.backward(loss)
    return counting.n


def _backward_matmuls_at(stages: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(_backward_matmuls(stage, False), _backward_matmuls(stage, True)) for stage in stages]


def test_autograd_computes_no_gradient_of_a_frozen_weight():
    """Counted, each Linear's backward is a matmul for its weight's gradient and one for its input's, where
    either needs one. Nothing frozen: the input layer's weight (its input is data), two for each of 3
    blocks and two for the output layer: 9. Frozen (the input layer, block 0, block 1's LayerNorm): nothing
    before block 1's Linear trains, so no gradient flows into it or below: its weight's gradient (1), block
    2's two and the output's two: 5. A mask over one buffer would still compute all 9. At stages 0 and 3."""
    for stage, both in zip((0, 3), in_world(1, _backward_matmuls_at, (0, 3))[0]):
        assert both == (9, 5), f"stage {stage}: backward matmuls, nothing frozen and frozen: {both}"


def _eager_and_whole() -> dict:
    """Each stage's frozen model trained eager and compiled whole (aot_eager), 3 steps on this rank's share
    of the same global batches: per stage the losses', parameters' relative error, whether the frozen
    parameters are unchanged, what only the eager ledger holds and what only the compiled one holds, and
    the bytes of a broadcast of each frozen part's slot."""
    from tests.test_whole_step import apart, sent
    from zerofunc.step import train_step
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = "aot_eager"
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for stage in range(4):
        runs = {}
        for compile in (False, "whole"):
            model = frozen_model("tokens")
            frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
            engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                                 "gradient_clipping": 0.05, "zero_optimization": {"stage": stage},
                                                 "optimizer": OPTIM, **({"compile": compile} if compile else {})})
            gen, losses = torch.Generator().manual_seed(1), []
            for _ in range(3):
                x, y = batches("tokens", 2 * world * 2, gen)
                everyone = [(x[i:i + 2], y[i:i + 2]) for i in range(0, len(x), 2)]
                losses.append(train_step(engine, everyone[rank::world]).item())
            after = engine.full_parameters()
            runs[compile] = (losses, after, all(torch.equal(after[n], t) for n, t in frozen.items()), sent(engine))
            slots = {u.frozen.params.numel() * u.frozen.params.element_size() for u in engine.units
                     if u.frozen is not None}
        (eager_losses, eager, _, eager_sent), (whole_losses, whole, kept, whole_sent) = runs[False], runs["whole"]
        out[stage] = (apart(eager_losses, whole_losses), apart(eager, whole), kept, eager_sent - whole_sent,
                      whole_sent - eager_sent, slots)
    return out


@pytest.mark.slow
def test_frozen_parameters_compiled_whole_train_like_eager():
    """The step compiled whole carries a unit's frozen part as the eager step does: as values with no
    gradient (whole at stages 0-2, gathered forward and again in backward at stage 3, never reduced), the
    trainable ones as before. At every stage on 2 ranks, with accumulation and clipping, its losses and
    parameters are the eager step's within tests/test_whole_step.py's derived 1e-5 and the frozen parameters
    bit for bit unchanged. The model freezes part of the root unit (its embedding), a whole block and part
    of a block.

    Its ledger is the eager step's, but for one difference, at stage 3: in backward the compiled step
    gathers a frozen part again only where a gradient needs it, and eager gathers a unit's two parts
    together. Here the root's head trains and its frozen embedding needs no backward, so eager's backward
    gathers the embedding too, and the compiled step does not (each slot a broadcast of its own, gloo's
    ops). So: nothing only the compiled step sends, and only backward gathers of frozen slots only eager's."""
    for stage, (loss_err, param_err, kept, only_eager, only_whole, slots) in in_world(2, _eager_and_whole)[0].items():
        assert kept, f"stage {stage}: a frozen parameter changed"
        assert not only_whole, f"stage {stage}: only the compiled step sent {only_whole}"
        assert all(tag == "params.bwd" and nbytes in slots for _, _, nbytes, tag in only_eager) and \
            (stage == 3) == bool(only_eager), f"stage {stage}: only eager sent {only_eager} (frozen slots {slots})"
        assert loss_err <= 1e-5, f"stage {stage}: losses differ by {loss_err:.1e}"
        assert param_err <= 1e-5, f"stage {stage}: parameters differ by {param_err:.1e}"
