"""Every ZeRO stage trains exactly like one device on the same global batch, and with a memory lever on
exactly like with it off."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from tests.bare import OPTIM, close, in_world, rel_err
from tests.worlds import COLLECTIVE_RULES, Case, IN_RANK, agreed_max, global_batches, reference_model, small_cases
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import build_model
from zerofunc.overlap import DEFAULT_BUCKET_BYTES, Overlap
from zerofunc.recompute import MODES, ActivationCheckpointing
from zerofunc.stages import STAGES

STEPS = 3
TOL = 1e-5


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


def reference_run(case: Case, training: Training, world_size: int):
    """Single-process training with torch.optim.AdamW on each whole global batch.

    A global batch is world_size x grad_accum micro-batches; it is one batch here.
    """
    model = reference_model(case)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay, foreach=False)
    first_grads = None
    for x, y, ids in global_batches(case, world_size * training.grad_accum, STEPS):
        model(x, y, ids).backward()
        if first_grads is None:  # as reduced, before clipping
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if training.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.clip)
        opt.step()
        opt.zero_grad()
    return first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(case: Case, training: Training, stage: int, levers: Levers | None = None):
    """The same global batches on this rank's engine: micro-step j of rank r takes micro-batch j*N + r."""
    comm = DistCommunicator(link=COLLECTIVE_RULES[training.collectives])
    rank, world = comm.rank, comm.world_size
    with torch.device("meta"):
        model = build_model(case.cfg)
    engine = ZeroEngine(model, STAGES[stage], comm, OPTIM, init=lambda n, s: model.init_param(n, s, case.seed),
                        grad_accum=training.grad_accum, clip=training.clip, overlap=training.overlap,
                        checkpointing=levers.checkpointing if levers else ActivationCheckpointing(),
                        offload_optimizer=levers.offload if levers else False)
    initial = engine.full_parameters()
    mb = case.micro_batch
    first_grads = None
    for batch in global_batches(case, world * training.grad_accum, STEPS):
        for j in range(training.grad_accum):
            lo = (j * world + rank) * mb
            engine.backward(engine(*(t[lo:lo + mb] for t in batch)))
        if first_grads is None:
            first_grads = engine.full_gradients()
        assert engine.step()
    return initial, first_grads, engine.full_parameters()


def check_all_stages(max_examples: int) -> int:
    world = dist.get_world_size()
    checked = []

    @settings(IN_RANK, max_examples=max_examples)
    @given(case=small_cases(), training=trainings, levers=leverss)
    def prop(case, training, levers):
        ref_grads, ref_params = reference_run(case, training, world)
        init = reference_model(case).state_dict()
        runs = {}
        for stage in STAGES:
            initial, grads, params = runs[stage] = engine_run(case, training, stage)
            init_err = agreed_max(max(rel_err(initial[n], init[n]) if init[n].norm() > 0 else 0.0 for n in init))
            assert init_err == 0.0, f"stage {stage}: initial weights depend on the world size ({init_err})"
            zero = agreed_max(float(sum(g.norm() == 0 for g in grads.values())))
            assert zero == 0, f"stage {stage}: some parameters have an all-zero gradient"
            g_err = agreed_max(max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))
            assert g_err <= TOL, f"stage {stage}: gradients differ from one device by {g_err:.2e}"
            errs = {n: rel_err(params[n], ref_params[n]) for n in ref_params}
            worst = max(errs, key=errs.get)
            p_err = agreed_max(errs[worst])
            assert p_err <= TOL, (f"stage {stage}, {training}: parameters after {STEPS} steps differ by {p_err:.2e} "
                                  f"(worst here: {worst} {errs[worst]:.2e})")
        check_levers(case, training, levers, runs[levers.stage])
        checked.append(type(case.cfg).__name__)

    prop()
    return sorted(set(checked)), len(checked)


def check_levers(case: Case, training: Training, levers: Levers, plain) -> None:
    """The stage trained with the drawn levers against the same stage without them: the gradients
    bit for bit (recomputation redoes the same ops; offload only copies them), the parameters bit
    for bit under checkpointing alone, and within 1e-6 of max(1, |w|) with offload (torch's fused
    CPU AdamW rounds differently from the reference's separate ops)."""
    _, plain_grads, plain_params = plain
    _, grads, params = engine_run(case, training, levers.stage, levers)
    what = f"stage {levers.stage}, {levers}"
    assert agreed_max(float(any(not torch.equal(grads[n], plain_grads[n]) for n in grads))) == 0, \
        f"{what}: gradients differ from training without the levers"
    if levers.offload:
        worst = agreed_max(max(close(params[n], plain_params[n])[1] / close(params[n], plain_params[n])[2]
                               for n in params))
        assert worst <= 1.0, f"{what}: parameters beyond 1e-6 of training without offload ({worst:.2f} x tolerance)"
    else:
        assert agreed_max(float(any(not torch.equal(params[n], plain_params[n]) for n in params))) == 0, \
            f"{what}: parameters differ from training without checkpointing"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_stage_trains_like_one_device(world_size):
    """ZEROFUNC_EXAMPLES=40 draws more cases per world size than the default 6."""
    results = in_world(world_size, check_all_stages, int(os.environ.get("ZEROFUNC_EXAMPLES", 6)))
    families, count = results[0]
    assert count >= min(6, int(os.environ.get("ZEROFUNC_EXAMPLES", 6))) and len({r[1] for r in results}) == 1
    assert families == ["GPTConfig", "LlamaConfig"], f"drew only {families}"
