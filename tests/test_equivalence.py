"""Every ZeRO stage trains like one device on the same global batch, step by step, within what fp32
rounding may legitimately change (tests/steps.py, with budgets that tests/rounding.py derives);
and with a memory lever on, exactly like with it off. The targets carry ignored positions (-100)
whose counts differ between ranks and micro-steps: the loss is the global batch's token mean."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.bare import OPTIM, in_world
from tests.steps import Step, agreed_max, check_steps, counted, ignore_some, record_step
from tests.worlds import (COLLECTIVE_RULES, Case, IN_RANK, examples_in_world, global_batches,
                          reference_model, small_cases)
from zerofunc.comm import DistCommunicator, RecordingCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPTConfig, LlamaConfig, build_model
from zerofunc.overlap import DEFAULT_BUCKET_BYTES, Overlap
from zerofunc.recompute import MODES, ActivationCheckpointing
from zerofunc.stages import STAGES
from zerofunc.step import train_step

STEPS = 3


@dataclass(frozen=True)
class Training:
    """How a case trains: micro-steps per optimizer step, the clipping norm (0: off), and how
    much communication is in flight (prefetch depth; bucket bytes: 0 waits for every
    reduction at once, 4 KiB lets a few small blocks' reductions run behind backward), and
    the rule that chooses each collective (tests.worlds.COLLECTIVE_RULES)."""

    grad_accum: int
    clip: float
    overlap: Overlap = Overlap()
    collectives: str = "gloo's rates"


trainings = st.builds(Training, grad_accum=st.integers(1, 3), clip=st.sampled_from([0.0, 0.05]),
                      overlap=st.builds(Overlap, prefetch_depth=st.integers(0, 2),
                                        bucket_bytes=st.sampled_from([0, 4096, DEFAULT_BUCKET_BYTES])),
                      collectives=st.sampled_from(list(COLLECTIVE_RULES)))


@dataclass(frozen=True)
class Levers:
    """The memory levers drawn for one stage of a case (offload exists at stages 1-3 only)."""

    stage: int
    checkpointing: ActivationCheckpointing
    offload: bool


leverss = st.builds(lambda stage, ac, every, offload: Levers(stage, ActivationCheckpointing(ac, every), offload and stage > 0),
                    st.sampled_from(list(STAGES)), st.sampled_from(MODES), st.integers(1, 3), st.booleans())


def engine_run(case: Case, training: Training, stage: int, levers: Levers | None = None) -> list[Step]:
    """The same global batches on this rank's engine: micro-step j of rank r takes micro-batch j*N + r."""
    comm = DistCommunicator(link=COLLECTIVE_RULES[training.collectives])
    rank, world = comm.rank, comm.world_size
    with torch.device("meta"):
        model = build_model(case.cfg)
    engine = ZeroEngine(model, STAGES[stage], comm, OPTIM, init=lambda n, s: model.init_param(n, s, case.seed),
                        grad_accum=training.grad_accum, clip=training.clip, overlap=training.overlap,
                        checkpointing=levers.checkpointing if levers else ActivationCheckpointing(),
                        offload_optimizer=levers.offload if levers else False)
    mb, steps = case.micro_batch, []
    gen = torch.Generator().manual_seed(case.seed + 1)  # the same ignored targets on every rank and stage
    for inputs, targets, ids in global_batches(case, world * training.grad_accum, STEPS):
        batch = (inputs, ignore_some(targets, gen), ids)
        everyone = [tuple(t[i * mb:(i + 1) * mb] for t in batch) for i in range(world * training.grad_accum)]
        steps.append(record_step(engine, everyone[rank::world], everyone))
    return steps


def check_all_stages(max_examples: int) -> tuple[list[str], int, bool]:
    checked, uneven = [], []

    @settings(IN_RANK, max_examples=max_examples)
    @given(case=small_cases(), training=trainings, levers=leverss)
    def prop(case, training, levers):
        init = reference_model(case).state_dict()
        runs = {}
        for stage in STAGES:
            steps = runs[stage] = engine_run(case, training, stage)
            what = f"stage {stage}, {training}"
            moved = agreed_max(float(any(not torch.equal(steps[0].params[n], init[n]) for n in init)))
            assert moved == 0, f"{what}: initial weights depend on the world size"
            zero = agreed_max(float(sum(g.norm() == 0 for g in steps[0].grads.values())))
            assert zero == 0, f"{what}: some parameters have an all-zero gradient"
            check_steps(reference_model(case), steps, what)
        check_levers(case, training, levers, runs[levers.stage])
        checked.append(type(case.cfg).__name__)
        uneven.append(any(len({counted(b) for b in s.everyone}) > 1 for s in runs[0]))

    prop()
    return sorted(set(checked)), len(checked), any(uneven)


def check_levers(case: Case, training: Training, levers: Levers, plain: list[Step]) -> None:
    """The stage trained with the drawn levers against the same stage without them: the first
    step's gradients bit for bit (recomputation redoes the same ops; offload only copies them),
    and the weights after every step bit for bit under checkpointing alone. Offload runs torch's
    fused AdamW on the host, in another order than the device's: its every step is held to the
    same budgets as the stage's own."""
    steps = engine_run(case, training, levers.stage, levers)
    what = f"stage {levers.stage}, {training}, {levers}"
    assert agreed_max(float(any(not torch.equal(steps[0].grads[n], plain[0].grads[n]) for n in plain[0].grads))) == 0, \
        f"{what}: gradients differ from training without the levers"
    if levers.offload:
        check_steps(reference_model(case), steps, what)
    else:
        differ = any(not torch.equal(s.after[n], p.after[n]) for s, p in zip(steps, plain) for n in p.after)
        assert agreed_max(float(differ)) == 0, f"{what}: parameters differ from training without checkpointing"


@pytest.mark.parametrize("world_size", [1, *(pytest.param(n, marks=pytest.mark.slow) for n in (2, 3, 4))])
def test_every_stage_trains_like_one_device(world_size):
    """Each world draws examples_in_world() cases: 6, or the hypothesis profile's (`--hypothesis-profile
    full`: 40, `fast`: 2). Even one rank runs in a process of its own: a gloo group in pytest's own process
    risks gloo's abort at interpreter exit (../shared/DESIGN.md), which the launcher's ranks avoid."""
    examples = examples_in_world()
    results = in_world(world_size, check_all_stages, examples)
    families, count, uneven = results[0]
    assert count >= min(6, examples) and len({r[1] for r in results}) == 1
    assert families == ["GPTConfig", "LlamaConfig"], f"drew only {families}"
    assert uneven, "no case drew micro-batches that count different numbers of targets"


# ---- the global count, on one rank in this process (a recording communicator over one rank moves no
# data and needs none moved, so stage 0 trains here without a process group) ----------------------

def one_rank_engine(cfg, grad_accum: int) -> tuple[ZeroEngine, torch.nn.Module]:
    with torch.device("meta"):
        model = build_model(cfg)
    engine = ZeroEngine(model, STAGES[0], RecordingCommunicator(0, 1), OPTIM, grad_accum=grad_accum,
                        init=lambda n, s: model.init_param(n, s, 0))
    return engine, reference_model(Case(cfg, seed=0, micro_batch=2, seq=5))


TINY = {"gpt2": GPTConfig(n_layer=1, n_head=1, n_embd=6, vocab_size=11, block_size=5),
        "llama": LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=4, intermediate_size=5, vocab_size=11,
                             block_size=5)}


@pytest.mark.parametrize("family", TINY)
def test_without_ignored_targets_the_loss_is_each_micro_batch_mean_bit_for_bit(family):
    """With every target counted and equal micro-batches, num_items_in_batch is each micro-batch's own count
    exactly: the step's loss is the mean of the micro-batches' plain means, bit for bit, as before the
    global count; which costs one all-reduce of 8 bytes, tagged "tokens"."""
    engine, reference = one_rank_engine(TINY[family], grad_accum=2)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 11, (4, 6), generator=gen)
    mine = [(rows[:2, :-1], rows[:2, 1:]), (rows[2:, :-1], rows[2:, 1:])]
    with torch.no_grad():
        plain = [reference(*batch) for batch in mine]
    logged = train_step(engine, mine)
    assert torch.equal(logged, (plain[0] + plain[1]) / 2)
    assert [(e.op, e.dtype, e.nbytes) for e in engine.comm.ledger if e.tag == "tokens"] == [("all_reduce", "int64", 8)]


def test_a_global_batch_with_no_counted_target_has_a_zero_loss_and_zero_gradients():
    """Every target ignored: the count is taken as 1, so the loss is 0 and the gradients are 0, never NaN
    (0 / 0); the step then moves the weights by AdamW's weight decay alone, finitely."""
    engine, _ = one_rank_engine(TINY["gpt2"], grad_accum=2)
    inputs = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(4))
    ignored = torch.full_like(inputs, -100)
    step = record_step(engine, [(inputs, ignored)] * 2, [(inputs, ignored)] * 2)
    assert step.loss == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in step.grads.values())
    assert all(torch.isfinite(p).all() for p in step.after.values())


def test_a_model_without_the_keyword_keeps_its_own_loss_and_no_count_is_sent():
    """A forward that takes no num_items_in_batch (a regression here) is called as before: no count, no
    collective for it."""
    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    engine = ZeroEngine(Regression(), STAGES[0], RecordingCommunicator(0, 1), OPTIM,
                        init=lambda n, s: torch.ones(s))
    train_step(engine, [(torch.ones(2, 3), torch.tensor([1, 2]))])  # integer targets, but no keyword
    assert "tokens" not in {e.tag for e in engine.comm.ledger}
