"""Every ZeRO stage trains exactly like one device on the same global batch."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

from tests.worlds import IN_RANK, agreed_max, global_batches, in_world, reference_model, rel_err, small_cases
from zerofunc.comm import DistCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPT
from zerofunc.optim import AdamWConfig
from zerofunc.stages import STAGES

STEPS = 3
# eps 1e-5, not 1e-8: attention's key bias has an exactly-zero true gradient (softmax
# ignores a constant added to a row of scores), so its computed gradient is 1e-11 to
# 1e-10 of rounding noise whose sign depends on summation order. Adam divides by
# sqrt(v) + eps, so with eps 1e-8 that noise becomes an lr-sized step that differs
# between any two summation orders (one device vs. N ranks); with 1e-6 it still
# reached 1.4e-5 of that bias. 1e-5 stays well below the real gradients here (1e-4 to
# 1e-2), and the gradients are compared directly as well, at 1e-5.
OPTIM = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
TOL = 1e-5


def reference_run(case, world_size):
    """Single-process training with torch.optim.AdamW: first-step grads and final params."""
    model = reference_model(case)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay, foreach=False)
    first_grads = None
    for x, y, ids in global_batches(case, world_size, STEPS):
        model(x, y, ids).backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(case, stage):
    comm = DistCommunicator()
    rank, world = comm.rank, comm.world_size
    with torch.device("meta"):
        model = GPT(case.cfg)
    engine = ZeroEngine(model, STAGES[stage], comm, OPTIM, init=lambda n, s: model.init_param(n, s, case.seed))
    initial = engine.full_parameters()
    mb = case.micro_batch
    first_grads = None
    for batch in global_batches(case, world, STEPS):
        loss = engine(*(t[rank * mb:(rank + 1) * mb] for t in batch))
        engine.backward(loss)
        if first_grads is None:
            first_grads = engine.full_gradients()
        engine.step()
    return initial, first_grads, engine.full_parameters()


def check_all_stages(max_examples: int) -> int:
    world = dist.get_world_size()
    checked = []

    @settings(IN_RANK, max_examples=max_examples)
    @given(case=small_cases())
    def prop(case):
        ref_grads, ref_params = reference_run(case, world)
        init = reference_model(case).state_dict()
        for stage in STAGES:
            initial, grads, params = engine_run(case, stage)
            init_err = agreed_max(max(rel_err(initial[n], init[n]) if init[n].norm() > 0 else 0.0 for n in init))
            assert init_err == 0.0, f"stage {stage}: initial weights depend on the world size ({init_err})"
            zero = agreed_max(float(sum(g.norm() == 0 for g in grads.values())))
            assert zero == 0, f"stage {stage}: some parameters have an all-zero gradient"
            g_err = agreed_max(max(rel_err(grads[n], ref_grads[n]) for n in ref_grads))
            assert g_err <= TOL, f"stage {stage}: gradients differ from one device by {g_err:.2e}"
            p_err = agreed_max(max(rel_err(params[n], ref_params[n]) for n in ref_params))
            assert p_err <= TOL, f"stage {stage}: parameters after {STEPS} steps differ by {p_err:.2e}"
        checked.append(case)

    prop()
    return len(checked)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_stage_trains_like_one_device(world_size):
    counts = in_world(world_size, check_all_stages, 6)
    assert counts[0] >= 6 and len(set(counts)) == 1
