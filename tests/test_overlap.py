"""Overlap's bookkeeping: the in-flight queue, and the buffers the planner charges for it.

That overlapped training still equals one device is tested with the other settings in
test_equivalence.py (drawn prefetch depths and bucket sizes); that the trainer issues
what the planner records, in test_ledger.py.
"""
from __future__ import annotations

from collections import Counter
from fractions import Fraction
from dataclasses import replace

import pytest
import torch

from sim.hardware import get_profile
from tests.modules import CHECKPOINTED, ORDERS, Ordered
from zerofunc.comm import GLOO_STAGING
from zerofunc.layout import FlatLayout
from zerofunc.models import GPT, GPTConfig
from zerofunc.overlap import NO_OVERLAP, InFlight, Overlap
from zerofunc.plan import Plan, simulate

# Five blocks and a small vocabulary, so blocks, not embeddings, set the buffer peaks.
CFG = GPTConfig(n_layer=5, n_head=2, n_embd=64, vocab_size=32, block_size=16)


class Handle:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def test_in_flight_waits_oldest_first_once_over_the_limit():
    log: list[str] = []
    q = InFlight(limit=100)
    for name, nbytes in [("a", 60), ("b", 30), ("c", 20), ("d", 100)]:
        q.add(Handle(log, name), nbytes, done=lambda n=name: log.append(f"done {n}"))
        log.append(f"added {name}")
    # c makes 110 > 100: a is waited; d makes 150: b and c are waited (d alone is 100, not over)
    assert log == ["added a", "added b", "wait a", "done a", "added c",
                   "wait b", "done b", "wait c", "done c", "added d"]
    assert q.bytes == 100 and len(q) == 1
    q.drain()
    assert log[-2:] == ["wait d", "done d"] and q.bytes == 0 and len(q) == 0


def test_zero_limit_is_synchronous():
    log: list[str] = []
    q = InFlight(limit=0)
    q.add(Handle(log, "a"), 8)
    assert log == ["wait a"] and len(q) == 0


def test_overlap_rejects_negative_settings():
    with pytest.raises(ValueError):
        Overlap(prefetch_depth=-1)
    with pytest.raises(ValueError):
        Plan(world_size=2, stage=3, model=CFG, bucket_bytes=-1)


def _buffers(stage: int, prefetch_depth: int, bucket_bytes: int) -> int:
    plan = Plan(world_size=2, stage=stage, model=CFG, precision="fp32", seq=16,
                prefetch_depth=prefetch_depth, bucket_bytes=bucket_bytes)
    return simulate(plan, timing=False).memory.max_by_category["buffers"]


def _block_bytes() -> int:
    """One block's gathered fp32 buffer, from the layout, not from the simulation."""
    with torch.device("meta"):
        model = GPT(CFG)
    block = model.shard_units()[0]
    named = [(n, p.shape) for n, p in model.get_submodule(block).named_parameters()]
    return FlatLayout.build(named, 2).padded_numel * 4


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_planner_charges_one_gathered_block_per_prefetch_depth(depth):
    assert _buffers(3, depth, 0) - _buffers(3, 0, 0) == depth * _block_bytes()


def test_planner_charges_gradients_waiting_in_a_bucket():
    # Stage 2 keeps each block's whole gradient until its reduce-scatter is waited on:
    # with everything in flight, all five blocks' gradients are live at the end of backward.
    synchronous, bucketed = _buffers(2, 0, 0), _buffers(2, 0, 1 << 30)
    assert bucketed - synchronous >= (CFG.n_layer - 1) * _block_bytes()


def test_overlap_changes_when_bytes_move_not_which():
    base = Plan(world_size=3, stage=3, model=CFG, precision="bf16", seq=16)
    overlapped, blocking = simulate(base), simulate(replace(base, **vars(NO_OVERLAP)))

    def entries(sim):
        return Counter(replace(e, overlapped=False) for e in sim.ledger)

    assert entries(overlapped) == entries(blocking)
    assert not any(e.overlapped for e in blocking.ledger)
    assert {e.tag for e in overlapped.ledger if e.overlapped} == {"grads", "params.fwd", "params.bwd"}
    assert blocking.step_s == pytest.approx(blocking.compute_s + blocking.comm_s)
    assert overlapped.step_s < blocking.step_s


def test_the_step_waits_for_what_it_waits_for_and_what_outlasts_its_compute():
    """sim.cost.replay on a schedule worked by hand: collectives of 1, 2, 1 and 4 s on one group's
    stream (an all-reduce of S bytes over 2 ranks takes S / bandwidth with no latency), a step of 5 s of
    compute. A (0-1 s) is done before its wait at 3 s: nothing. B (launched at 3) runs 3-5; C, blocking,
    launched at 3.5, queues behind B and runs 5-6: the compute stalls 2.5 s. D, launched at compute second
    4 (wall 6.5, the stream free since 6), runs 6.5-10.5 and is never waited for: the compute ends at
    5 + 2.5 = 7.5, so 3 s of D are exposed. 5.5 s in all; the old model (blocking time, plus what of the
    asynchronous time outlasts the whole compute) would say 1 s."""
    from sim.cost import Link, Replay, replay
    from sim.ledger import LedgerEntry

    links = {"world": Link(0.0, 1.0)}
    a, b, c, d = (LedgerEntry("all_reduce", "float32", n, 2, overlapped=o) for n, o in
                  ((1, True), (2, True), (1, False), (4, True)))
    events = [("launch", 0, 0.0), ("wait", 0, 3.0), ("launch", 1, 3.0), ("launch", 2, 3.5), ("wait", 2, 3.5),
              ("launch", 3, 4.0)]
    assert replay([a, b, c, d], events, links, compute_s=5.0).exposed_s == pytest.approx(5.5)
    # On a link whose collectives take 10% of the compute while they run beside it: A overlaps compute 1 s,
    # B 0.5 s (3-3.5; from 3.5 the compute is stalled), C none (it runs inside the stall), D 1 s (6.5-7.5,
    # until the compute ends): 2.5 s at 0.1.
    shared = {"world": Link(0.0, 1.0, compute_share=0.1)}
    assert replay([a, b, c, d], events, shared, compute_s=5.0) == Replay(pytest.approx(5.5), pytest.approx(0.25))
    # a communicator with the planner's clock records that schedule: each launch, and its first wait only
    from zerofunc.comm import RecordingCommunicator
    comm, now = RecordingCommunicator(0, 2), [0.0]
    comm.clock = lambda: now[0]
    handle = comm.all_reduce(torch.zeros(4, device="meta"), async_op=True)
    now[0] = 2.0
    handle.wait()
    handle.wait()
    comm.all_reduce(torch.zeros(4, device="meta"))
    assert comm.ledger.events == [("launch", 0, 0.0), ("wait", 0, 2.0), ("launch", 1, 2.0), ("wait", 1, 2.0)]


def _gloo_staging() -> tuple[int, int, int]:
    """Bytes a blocking gloo reduce-scatter allocates in the calling thread; what the
    communicator counts for an asynchronous one before and after waiting."""
    import torch.distributed as dist

    from sim.memory import MemoryTracker
    from zerofunc.comm import DistCommunicator, reduce_scatter_single

    observed = MemoryTracker()
    with observed:
        inp, out = torch.ones(1000), torch.empty(1000 // dist.get_world_size())
        before = observed.peak
        reduce_scatter_single(out, inp)
    comm, counted = DistCommunicator(link=None), MemoryTracker()  # gloo's own reduce-scatter
    comm.memory = counted
    with counted:
        handle = comm.reduce_scatter(out, inp, async_op=True)
        during = counted.live["buffers"]
        handle.wait()
    return observed.peak - before, during, counted.live["buffers"]


def test_gloo_staging_is_what_the_communicator_counts():
    from tests.bare import in_world
    for observed, during, after in in_world(2, _gloo_staging):
        assert observed == 4000  # a full copy of the 4000-byte input: comm.GLOO_STAGING
        assert (during, after) == (4000, 0)
    assert get_profile("cpu-gloo").collective_staging == GLOO_STAGING  # what the planner assumes for gloo


def _most_blocks_gathered(overlap_comm: bool, checkpointing: bool) -> tuple[int, int]:
    """(the most blocks gathered at once during two stage-3 steps, 1 + the engine's prefetch depth), as
    rank 0 of a simulated world of 3 (a fresh process: it needs one without a process group)."""
    from zerofunc.api import initialize
    from zerofunc.check.world import simulated_world
    from zerofunc.models import build_model
    from zerofunc.step import train_step

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "overlap_comm": overlap_comm}}
    if checkpointing:
        config["activation_checkpointing"] = {}
    with simulated_world(3) as comm:
        engine = initialize(build_model(CFG), config, comm=comm, device="cpu")
        gathering, most = engine.gathering, watch_gathered(engine.gathering)
        ids = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1))
        for _ in range(2):
            train_step(engine, [(ids[:, :-1], ids[:, 1:])])
        return most(), 1 + gathering.overlap.prefetch_depth


CASES = [(overlap_comm, checkpointing) for overlap_comm in (False, True) for checkpointing in (False, True)]


def _every_case() -> dict:
    return {case: _most_blocks_gathered(*case) for case in CASES}


def watch_gathered(gathering):
    """Watch a stage-3 engine's gathering: every change of what is gathered passes through its `gather` or
    `release`. Returns a function giving the most blocks gathered at once so far."""
    most = 0
    for name in ("gather", "release"):
        def counted(*args, real=getattr(gathering, name), **kwargs):
            nonlocal most
            real(*args, **kwargs)
            most = max(most, sum(u.gathered for u in gathering.blocks))
        setattr(gathering, name, counted)
    return lambda: most


def in_a_fresh_process(fn, *args):
    """`fn(*args)` in a spawned process: a simulated world needs one without a process group."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


@pytest.fixture(scope="module")
def most_gathered() -> dict:
    return in_a_fresh_process(_every_case)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("overlap_comm", [False, True], ids=["depth-0", "depth-1"])
def test_stage_3_holds_at_most_one_block_and_its_prefetch_gathered(most_gathered, overlap_comm, checkpointing):
    """ZeRO-3's memory promise: at any moment of a step, forward or backward, the gathered blocks are the
    one computing and the `prefetch_depth` being gathered for what runs next, never more (the planner
    charges exactly these, test_planner_charges_one_gathered_block_per_prefetch_depth). A block kept
    past its backward, or a prefetch that runs ahead, breaks it."""
    most, bound = most_gathered[overlap_comm, checkpointing]
    assert bound == (2 if overlap_comm else 1)
    assert most == bound, f"{most} of {CFG.n_layer} blocks gathered at once, against 1 + prefetch depth = {bound}"


def _gathers_in_order(order: tuple[int, ...], overlap_comm: bool,
                      checkpointed: bool) -> tuple[int, int, list[tuple[int, int]]]:
    """Three stage-3 steps of `Ordered(order, checkpointed)` as rank 0 of a simulated world of 3: (the most blocks
    gathered at once, 1 + the prefetch depth, each step's (forward, backward) gathers as the ledger has them)."""
    from zerofunc.api import initialize
    from zerofunc.check.world import simulated_world
    from zerofunc.step import train_step

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "overlap_comm": overlap_comm}}
    torch.manual_seed(0)
    with simulated_world(3) as comm:
        engine = initialize(Ordered(order, checkpointed), config, comm=comm, device="cpu")
        gathering, most = engine.gathering, watch_gathered(engine.gathering)
        ids, steps = torch.randint(0, 19, (2, 7)), []
        for _ in range(3):
            before = len(comm.ledger.entries)
            train_step(engine, [(ids[:, :-1], ids[:, 1:])])
            gathers = Counter()  # on gloo a gather is one broadcast per rank (zerofunc/comm.py)
            for e in comm.ledger.entries[before:]:
                gathers[e.tag] += {"all_gather": 1, "broadcast": Fraction(1, e.group_size)}.get(e.op, 0)
            steps.append((gathers["params.fwd"], gathers["params.bwd"]))
        return most(), 1 + gathering.overlap.prefetch_depth, steps


def _every_order() -> dict:
    return {(name, overlap_comm): _gathers_in_order(ORDERS[name], overlap_comm, name == CHECKPOINTED)
            for name in ORDERS for overlap_comm in (False, True)}


@pytest.fixture(scope="module")
def gathers_in_order() -> dict:
    return in_a_fresh_process(_every_order)


@pytest.mark.parametrize("overlap_comm", [False, True], ids=["depth-0", "depth-1"])
@pytest.mark.parametrize("name", ORDERS)
def test_stage_3_prefetches_in_the_order_the_forward_runs_its_blocks(gathers_in_order, name, overlap_comm):
    """Any nn.Module's forward picks its blocks' order: stage 3 prefetches what ran next in the last forward
    (DeepSpeed's trace). Its first step guesses the modules' order, and a wrong guess costs a gather, never
    memory: the gathered blocks stay the one computing and the prefetch depth. Once the order is learned, each
    run of a block is gathered once in forward and once in backward (a block run twice in a row once: it is
    kept), as are the embeddings and head (the root unit); prefetching in the modules' order instead gathers
    blocks that do not run next, and holds them. A block the model checkpoints itself is gathered in backward
    once, for its recomputation and its backward."""
    order = ORDERS[name]
    most, bound, steps = gathers_in_order[name, overlap_comm]
    assert most <= bound, f"{most} blocks gathered at once, against 1 + prefetch depth = {bound}"
    runs = 1 + sum(1 for i, b in enumerate(order) if i == 0 or order[i - 1] != b)  # the root, then each block's runs
    assert steps[1:] == [(runs, runs)] * 2
    if order == ORDERS["modules'"]:  # the first step's guess is right
        assert steps[0] == (runs, runs)
