"""Every ZeRO stage trains like one device on the same global batch, step by step, within what fp32
rounding may legitimately change (tests/steps.py, with budgets that tests/rounding.py derives);
and with a memory lever on, exactly like with it off."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.bare import OPTIM, in_world
from tests.steps import Step, agreed_max, check_steps, record_step
from tests.worlds import (COLLECTIVE_RULES, Case, IN_RANK, examples_in_world, global_batches,
                          reference_model, small_cases)
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import build_model
from zerofunc.overlap import DEFAULT_BUCKET_BYTES, Overlap
from zerofunc.recompute import MODES, ActivationCheckpointing
from zerofunc.stages import STAGES

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
    for batch in global_batches(case, world * training.grad_accum, STEPS):
        everyone = [tuple(t[i * mb:(i + 1) * mb] for t in batch) for i in range(world * training.grad_accum)]
        steps.append(record_step(engine, everyone[rank::world], everyone))
    return steps


def check_all_stages(max_examples: int) -> tuple[list[str], int]:
    checked = []

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

    prop()
    return sorted(set(checked)), len(checked)


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
    families, count = results[0]
    assert count >= min(6, examples) and len({r[1] for r in results}) == 1
    assert families == ["GPTConfig", "LlamaConfig"], f"drew only {families}"
