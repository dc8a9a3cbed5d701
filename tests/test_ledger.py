"""One step's ledger: the ZeRO paper's volumes where the backend's rates keep the paper's collectives,
the volume actually sent where they do not, and the simulated step's ledger, entry by entry.

What is counted: Ψ is the number of parameters; each unit's flat buffer is padded to
N shards of a multiple of 16 elements each (zerofunc.layout.ALIGN), so the buffers hold
Ψp = Σ padded(unit) >= Ψ elements, fewer than 16N more per unit, and the collectives
move Ψp. Volumes count as the paper does: an all-reduce of S bytes is 2S (reduce-scatter
+ all-gather), an all-gather or reduce-scatter of S bytes is S. Per rank, a ring sends (N-1)/N of that.
  stage 0:   all-reduce Ψp of gradients                          = 2Ψp
  stage 1-2: reduce-scatter Ψp of gradients + all-gather Ψp of
             updated parameters                                  = 2Ψp
  stage 3:   all-gather Ψp in forward + all-gather Ψp in backward
             + reduce-scatter Ψp of gradients                    = 3Ψp
Each unit appears exactly once in each line.

The rule per backend: on a link with one bandwidth for every op (NCCL's profiles, or no
rates at all) every collective is the paper's. On gloo, whose measured reduce-scatter and
large all-gathers are slower than its all-reduce (the cpu-gloo profile), a unit's
reduce-scatter or all-gather is issued as an all-reduce of the same buffer wherever the
profile's times make that at least 10% quicker; the ledger then holds the all-reduce, so
its volume is what was sent (2S where the paper counts S).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings

from tests.bare import in_world
from tests.steps import agreed_max
from tests.worlds import COLLECTIVE_RULES, IN_RANK, global_batches, small_cases
from sim.cost import Link, issued_as
from sim.hardware import get_profile
from sim.ledger import VOLUME_FACTOR
from zerofunc.comm import DistCommunicator, RecordingCommunicator
from zerofunc.engine import ZeroEngine
from zerofunc.layout import ALIGN
from zerofunc.models import GPT, build_model
from zerofunc.optim import AdamWConfig
from zerofunc.stages import STAGES

PAPER = {  # stage -> {(op, tag) each unit appears in once}, the paper's collectives
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


def issued(op: str, nbytes: int, n: int, link) -> str:
    """The rule: the paper's op, or the stand-in (an all-reduce; for an all-gather, broadcasts) that
    the link's rates make quickest, if at least 10% quicker."""
    return issued_as(op, nbytes, n, link)


def entries_for(op: str, nbytes: int, n: int, link) -> list[tuple[str, int]]:
    """The (op, bytes) ledger entries one collective of a unit of `nbytes` is issued as: itself, an
    all-reduce of the same buffer, or one broadcast of each rank's slot."""
    as_op = issued(op, nbytes, n, link)
    return [(as_op, nbytes // n)] * n if as_op == "broadcast" else [(as_op, nbytes)]


def check_ledgers(max_examples):
    @settings(IN_RANK, max_examples=max_examples)
    @given(case=small_cases())
    def prop(case):
        for stage in STAGES:
            comm = DistCommunicator()  # gloo, choosing by the cpu-gloo profile's rates
            n = comm.world_size
            assert comm.link == get_profile("cpu-gloo").link(n)
            engine = one_step(case, stage, comm, "cpu")
            padded = [u.layout.padded_numel for u in engine.units]
            psi, psi_p = engine.numel, sum(padded)
            assert 0 <= psi_p - psi < n * ALIGN * len(padded)
            assert all(p % (n * ALIGN) == 0 for p in padded)

            # besides the paper's volumes, one scalar all-reduce of the squared gradient norm over the
            # shards (which skips a non-finite step); stage 0's gradients are whole on every rank
            norms = [(e.op, e.nbytes) for e in comm.ledger.entries if e.tag == "grad_norm"]
            assert norms == ([] if stage == 0 else [("all_reduce", 4)])
            entries = [e for e in comm.ledger.entries if e.tag != "grad_norm"]
            assert {e.tag for e in entries} == {tag for _, tag in PAPER[stage]}, f"stage {stage}: {entries}"
            volume = 0
            for op, tag in PAPER[stage]:  # each unit once per line, as the op gloo's rates choose
                got = sorted((e.op, e.nbytes) for e in entries if e.tag == tag)
                want = sorted(sum((entries_for(op, 4 * p, n, comm.link) for p in padded), []))
                assert got == want, f"stage {stage} {tag}: {got} vs units {want}"
                volume += sum(VOLUME_FACTOR[o] * b for o, b in want)
            assert all(e.group_size == n and e.dtype == "float32" for e in entries)
            assert sum(e.volume_bytes for e in entries) == volume  # the volume sent
            ring = sum(e.ring_bytes_per_rank for e in entries)
            assert ring == pytest.approx(volume * (n - 1) / n)

            # The same step on meta tensors with the recording communicator and gloo's rates: same ledger.
            simulated = RecordingCommunicator(comm.rank, n, link=get_profile("cpu-gloo").link(n))
            one_step(case, stage, simulated, "meta")
            mismatch = float(simulated.ledger.entries != comm.ledger.entries)
            assert agreed_max(mismatch) == 0, f"stage {stage}: simulated ledger differs from executed"

            # NCCL's rates (an H100 node's links): the paper's collectives and volumes exactly.
            paper = RecordingCommunicator(comm.rank, n, link=get_profile("h100-sxm").link(n))
            one_step(case, stage, paper, "meta")
            kinds = Counter((e.op, e.tag) for e in paper.ledger.entries if e.tag != "grad_norm")
            assert set(kinds) == PAPER[stage] and all(c == len(padded) for c in kinds.values())
            assert paper.ledger.volume_bytes("grads", "params") == PAPER_FACTOR[stage] * 4 * psi_p

    prop()
    return True


def _measured(**seconds: float) -> Link:
    """A 2-rank link of measured times of its own: each op takes the same time at every size."""
    return Link(0.0, 1.0, op_seconds={op: ((1.0, t), (2.0**40, t)) for op, t in seconds.items()})


def test_gloo_rule_stands_in_where_the_measured_times_say():
    """The rule on times of the test's own, not on any machine's recording (the cpu-gloo profile's
    figures are whatever the last `--record` measured): a reduce-scatter that takes 3x the all-reduce
    of its buffer is issued as that all-reduce; an all-gather that takes 3x the broadcasts of its slots,
    as those broadcasts; a stand-in only 5% quicker does not stand in (STAND_IN_MARGIN). On an H100
    node's links, and with no rates, never a stand-in."""
    payload = 64 << 20
    slow = _measured(reduce_scatter=3.0, all_gather=3.0, all_reduce=1.0, broadcast=0.25)  # gloo's shape
    assert issued("reduce_scatter", payload, 2, slow) == "all_reduce"
    assert issued("all_gather", payload, 2, slow) == "broadcast"  # 2 x 0.25 s, quicker than an all-reduce
    near = _measured(reduce_scatter=1.0, all_gather=1.0, all_reduce=0.95, broadcast=0.475)
    assert issued("reduce_scatter", payload, 2, near) == "reduce_scatter"
    assert issued("all_gather", payload, 2, near) == "all_gather"
    for op in ("reduce_scatter", "all_gather"):
        for other in (get_profile("h100-sxm").link(8), None):
            assert all(issued(op, s, 8, other) == op for s in (4, 1 << 20, 1 << 30))


def test_measured_times_are_read_between_points_and_scaled_past_them():
    """A link's measured times: the first below it, linear between points, the last point's
    bandwidth beyond it (a falling last segment must not make a bigger collective free), and
    alpha per hop more for a bigger group than the one measured."""
    link = Link(1e-3, 1.0, op_seconds={"all_gather": ((100.0, 1.0), (200.0, 3.0), (300.0, 2.0))})
    assert link.time("all_gather", 10.0, 2) == 1.0
    assert link.time("all_gather", 150.0, 2) == pytest.approx(2.0)
    assert link.time("all_gather", 600.0, 2) == pytest.approx(4.0)
    assert link.time("all_gather", 150.0, 4) == pytest.approx(2.0 + 2e-3)
    assert link.time("all_gather", 150.0, 1) == 0.0


@pytest.mark.slow
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


def _collectives_both_ways():
    """Every rank's distinct integer-valued shards (exact in any summation order), gathered and
    reduced by the paper's collectives, by all-reduces standing in for them, and gathered by broadcasts.
    The gathered shards hold both zeros, -0.0 and +0.0, which a gather must keep bit for bit."""
    import torch.distributed as dist
    rank, n, k = dist.get_rank(), dist.get_world_size(), 5
    results = []
    for link in (None, COLLECTIVE_RULES["all-reduce"], COLLECTIVE_RULES["broadcast"]):
        comm = DistCommunicator(link=link)
        for async_op in (False, True):
            mine = signed_zeros(torch.arange(k, dtype=torch.float32) + 10 * rank)
            gathered = torch.full((k * n,), float("nan"))  # no stale value may survive where zeros belong
            full = torch.arange(k * n, dtype=torch.float32) * (rank + 1)
            summed, averaged = torch.full((k,), float("nan")), torch.full((k,), float("nan"))
            handles = [comm.all_gather(gathered, mine, async_op=async_op),
                       comm.reduce_scatter(summed, full.clone(), mean=False, async_op=async_op),
                       comm.reduce_scatter(averaged, full.clone(), async_op=async_op)]
            for h in handles:
                h.wait()
            results.append(([t.tolist() for t in (gathered, summed, averaged)], {e.op for e in comm.ledger}))
    return results, rank, n, k


def signed_zeros(shard: torch.Tensor) -> torch.Tensor:
    """The shard with its last two elements -0.0 and +0.0."""
    shard[-2:] = torch.tensor([-0.0, 0.0])
    return shard


@pytest.mark.slow
def test_a_stand_in_does_what_the_collective_it_stands_for_does():
    """3 gloo ranks: a gather is bit for bit the shards, however issued; sums of integers are exact."""
    for results, rank, n, k in in_world(3, _collectives_both_ways):
        want_gathered = torch.cat([signed_zeros(torch.arange(k, dtype=torch.float32) + 10 * r) for r in range(n)])
        want_summed = torch.arange(k * n, dtype=torch.float32)[rank * k:(rank + 1) * k] * sum(range(1, n + 1))
        for i, (tensors, ops) in enumerate(results):
            gathered, summed, averaged = map(torch.tensor, tensors)
            assert ops == [{"all_gather", "reduce_scatter"}, {"all_reduce"}, {"broadcast", "reduce_scatter"}][i // 2]
            assert torch.equal(gathered.view(torch.int32), want_gathered.view(torch.int32)), f"run {i}: {gathered}"
            assert torch.equal(summed, want_summed), f"run {i}: {summed}"
            assert torch.allclose(averaged, want_summed / n), f"run {i}: {averaged}"
