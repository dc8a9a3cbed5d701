"""One step's ledger matches the ZeRO paper's volumes, and the simulated step's ledger.

What is counted: Ψ is the number of parameters; each unit's flat buffer is padded to
a multiple of the world size, so the buffers hold Ψp = Σ padded(unit) >= Ψ elements,
fewer than N more per unit, and the collectives move Ψp. Volumes count as the paper
does: an all-reduce of S bytes is 2S (reduce-scatter + all-gather), an all-gather or
reduce-scatter of S bytes is S. Per rank, a ring sends (N-1)/N of that.
  stage 0:   all-reduce Ψp of gradients                          = 2Ψp
  stage 1-2: reduce-scatter Ψp of gradients + all-gather Ψp of
             updated parameters                                  = 2Ψp
  stage 3:   all-gather Ψp in forward + all-gather Ψp in backward
             + reduce-scatter Ψp of gradients                    = 3Ψp
Each unit appears exactly once in each line.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings

from tests.bare import in_world
from tests.worlds import IN_RANK, agreed_max, global_batches, small_cases
from zerofunc.comm import DistCommunicator, RecordingCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.models import GPT, build_model
from zerofunc.optim import AdamWConfig
from zerofunc.stages import STAGES

EXPECTED = {  # stage -> {(op, tag) each unit appears in once}
    0: {("all_reduce", "grads")},
    1: {("reduce_scatter", "grads"), ("all_gather", "params.step")},
    2: {("reduce_scatter", "grads"), ("all_gather", "params.step")},
    3: {("all_gather", "params.fwd"), ("all_gather", "params.bwd"), ("reduce_scatter", "grads")},
}
PAPER_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}


def one_step(case, stage, comm, device):
    with torch.device("meta"):
        model = build_model(case.cfg)
    init = None if device == "meta" else (lambda n, s: model.init_param(n, s, case.seed))
    engine = ZeroEngine(model, STAGES[stage], comm, AdamWConfig(), device=device, init=init)
    mb = case.micro_batch
    batch = (t[comm.rank * mb:(comm.rank + 1) * mb].to(device) for t in global_batches(case, comm.world_size, 1)[0])
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    return engine


def check_ledgers(max_examples):
    @settings(IN_RANK, max_examples=max_examples)
    @given(case=small_cases())
    def prop(case):
        for stage in STAGES:
            comm = DistCommunicator()
            n = comm.world_size
            engine = one_step(case, stage, comm, "cpu")
            padded = [u.layout.padded_numel for u in engine.units]
            psi, psi_p = engine.numel, sum(padded)
            assert 0 <= psi_p - psi < n * len(padded)

            # besides the paper's volumes, one scalar all-reduce of the squared gradient norm over the
            # shards (which skips a non-finite step); stage 0's gradients are whole on every rank
            norms = [(e.op, e.nbytes) for e in comm.ledger.entries if e.tag == "grad_norm"]
            assert norms == ([] if stage == 0 else [("all_reduce", 4)])
            entries = [e for e in comm.ledger.entries if e.tag != "grad_norm"]
            by_kind = Counter((e.op, e.tag) for e in entries)
            assert set(by_kind) == EXPECTED[stage], f"stage {stage}: {sorted(by_kind)}"
            for kind in EXPECTED[stage]:
                sizes = sorted(e.nbytes for e in entries if (e.op, e.tag) == kind)
                assert sizes == sorted(4 * p for p in padded), f"stage {stage} {kind}: {sizes} vs units {padded}"
            assert all(e.group_size == n and e.dtype == "float32" for e in entries)
            volume = sum(e.volume_bytes for e in entries)
            assert volume == PAPER_FACTOR[stage] * 4 * psi_p
            ring = sum(e.ring_bytes_per_rank for e in entries)
            assert ring == pytest.approx(volume * (n - 1) / n)

            # The same step on meta tensors with the recording communicator: same ledger.
            simulated = RecordingCommunicator(comm.rank, n)
            one_step(case, stage, simulated, "meta")
            mismatch = float(simulated.ledger.entries != comm.ledger.entries)
            assert agreed_max(mismatch) == 0, f"stage {stage}: simulated ledger differs from executed"

    prop()
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_one_step_moves_the_paper_volumes(world_size):
    assert all(in_world(world_size, check_ledgers, 3))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_communicates_as_the_stage_says(stage):
    """Stages 0-1 send nothing on a micro-step before the boundary; stages 2-3 reduce-scatter every micro-step."""
    from zerofunc.models import model_config
    comm = RecordingCommunicator(0, 4)
    with torch.device("meta"):
        model = GPT(model_config("gpt2-tiny", n_layer=2))
    engine = ZeroEngine(model, STAGES[stage], comm, AdamWConfig(), device="meta", grad_accum=3)
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    per_micro_step = []
    for _ in range(3):
        before = len(comm.ledger)
        engine.backward(engine(x, x))
        per_micro_step.append([(e.op, e.tag) for e in comm.ledger.entries[before:] if e.tag == "grads"])
        assert not engine.step() or len(per_micro_step) == 3
    units = len(engine.units)
    if stage <= 1:
        assert per_micro_step[:2] == [[], []] and len(per_micro_step[2]) == units
    else:
        assert all(len(m) == units and {op for op, _ in m} == {"reduce_scatter"} for m in per_micro_step)
