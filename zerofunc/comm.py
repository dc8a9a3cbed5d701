"""One communicator interface, two implementations.

`DistCommunicator` runs real collectives through torch.distributed (gloo on CPU,
NCCL on CUDA). `RecordingCommunicator` runs none: the tensors are meta tensors and it
only writes down what would have been sent. Both append identical ledger entries,
which is what lets the planner claim the trainer does exactly what it simulated.

Each collective is asked for by what it must achieve (reduce a buffer and keep this
rank's shard; gather every rank's shard), and issued as the op the backend runs
fastest, by its measured rates (`link`): on gloo a large reduce-scatter runs as an
all-reduce, which moves twice the bytes in less time and stages no copy, and an
all-gather as one broadcast per rank. The ledger holds the ops actually issued, so the
volume it reports is the volume sent. Without a link (`link=None`) every collective is
the ZeRO paper's.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from sim.cost import Link, issued_as
from sim.hardware import get_profile
from sim.ledger import Ledger, LedgerEntry
from sim.memory import NoMemoryTracking
from zerofunc.layout import shard

# torch 2.13 renamed the tensor-in/tensor-out collectives; keep working on either side.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle(Protocol):
    def wait(self) -> None: ...


class _Done:
    """The handle of a collective that has already completed."""

    def wait(self) -> None:
        return None


# Measured (tests/test_overlap.py): gloo's reduce-scatter stages a full copy of its input,
# held until the collective completes. NCCL allocates nothing through PyTorch.
GLOO_STAGING = {"reduce_scatter": 1.0}


class _Staged:
    """A collective's handle that also ends the backend staging counted for it, and then runs
    `then` (once): what makes an all-reduce the reduce-scatter it stands for."""

    def __init__(self, work: Handle, memory, key, then=None, waited=None):
        self.work, self.memory, self.key, self.then, self.waited = work, memory, key, then, waited

    def wait(self) -> None:
        with self.memory.backend():  # gloo may stage again while finishing (an AVG divides a copy)
            self.work.wait()
        if self.waited is not None:  # the planner's schedule: the step waits for it here
            waited, self.waited = self.waited, None
            waited()
        if self.key is not None:
            self.memory.drop(self.key)
            self.key = None
        if self.then is not None:
            then, self.then = self.then, None
            then()


class AllHandles:
    """The handle of several collectives issued together (an all-gather done as broadcasts)."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class Communicator:
    """Collectives over flat buffers. Subclasses implement `_run`; this class keeps the ledger.

    `mean=True` averages instead of summing, which is how gradients are reduced.
    `staging` is what the backend copies per collective, as a fraction of the payload;
    it is counted in `memory` (a sim.memory.MemoryTracker, set by the engine) as
    communication buffers from launch until the collective is waited on.
    `link` holds the backend's rates, by which a reduce-scatter or an all-gather is
    issued as another op where that is faster (sim.cost.issued_as).
    """

    staging: dict[str, float] = {}

    def __init__(self, rank: int, world_size: int, ledger: Optional[Ledger] = None, link: Optional[Link] = None):
        self.rank = rank
        self.world_size = world_size
        self.ledger = ledger if ledger is not None else Ledger()
        self.memory = NoMemoryTracking()
        self.link = link
        self.group_name = "world"  # the ledger's name for the ranks this communicator spans
        # the planner's clock (zerofunc.plan.simulate: the step's compute seconds so far): with one, the ledger
        # records when each collective is launched and first waited for (Ledger.events)
        self.clock: Optional[Callable[[], float]] = None

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "", async_op: bool = False) -> Handle:
        """Concatenate every rank's `inp` (one shard) into `out`.

        As an all-reduce: `out` holds `inp` in this rank's slot and -0.0 elsewhere, and the
        sum over ranks is then every rank's shard in its slot, bit for bit, in any summation
        order: x + (-0.0) is x for every x, +0.0 and -0.0 included, where +0.0 as the filler
        would turn a shard's -0.0 into +0.0 (-0.0 + 0.0 is +0.0 in round-to-nearest). As
        broadcasts: `out` holds `inp` in this rank's slot, and each rank's slot is broadcast
        from it, all launched at once.
        """
        n = self.world_size
        if out.numel() != inp.numel() * n:
            raise ValueError(f"all_gather: out has {out.numel()} elements, expected {inp.numel()} x {n}")
        op = self.gather_op(out)
        if op == "all_gather":
            return self._issue("all_gather", out, tag, async_op, out=out, inp=inp)
        slots = out.view(n, -1)
        slots[self.rank].copy_(inp.view(-1))
        if op == "all_reduce":  # every other slot -0.0: the sum leaves each rank's shard in its own
            slots[:self.rank].fill_(-0.0)
            slots[self.rank + 1:].fill_(-0.0)
            return self._issue("all_reduce", out, tag, async_op, out=out, mean=False)
        sends = AllHandles([self._issue("broadcast", slot, tag, async_op, launch_only=True, out=slot, src=r)
                      for r, slot in enumerate(slots)])
        if not async_op:
            sends.wait()
        return sends

    def gather_op(self, out: torch.Tensor) -> str:
        """The op an all-gather into `out` is issued as: all_gather, all_reduce or broadcast."""
        return issued_as("all_gather", out.numel() * out.element_size(), self.world_size, self.link)

    def reduce_scatter(self, out: Optional[torch.Tensor], inp: torch.Tensor, tag: str = "", mean: bool = True,
                       async_op: bool = False) -> Handle:
        """Reduce `inp` (full buffer) over ranks and keep this rank's shard in `out`; with `out=None`,
        in `inp`'s own slot of this rank (ZeRO-1 keeps the whole local gradient anyway).

        `inp` is the caller's to give up: as an all-reduce, it is reduced in place, and its
        shard copied into `out` (if given) once the collective is done. That sums the same
        terms as the reduce-scatter, though not necessarily in the same order: equal to the
        last bit where the order cannot matter (two ranks; sums exact in fp32), and otherwise
        within what reordering a sum may change (tests/rounding.py). The paper's
        reduce-scatter into `inp`'s own slot goes through a shard of `buffers`, copied back.
        """
        n = self.world_size
        if inp.numel() % n or (out is not None and inp.numel() != out.numel() * n):
            raise ValueError(f"reduce_scatter: inp has {inp.numel()} elements, expected "
                             f"{'a multiple of' if out is None else out.numel()} x {n}")
        mine = shard(inp, self.rank, n)
        if issued_as("reduce_scatter", inp.numel() * inp.element_size(), n, self.link) == "all_reduce":
            then = None if out is None else (lambda: out.copy_(mine))
            return self._issue("all_reduce", inp, tag, async_op, then=then, out=inp, mean=mean)
        then = None
        if out is None:
            with self.memory.category("buffers"):
                out = torch.empty_like(mine)
            then = lambda: mine.copy_(out)  # noqa: E731
        return self._issue("reduce_scatter", inp, tag, async_op, then=then, out=out, inp=inp, mean=mean)

    def all_reduce(self, t: torch.Tensor, tag: str = "", mean: bool = True, async_op: bool = False) -> Handle:
        return self._issue("all_reduce", t, tag, async_op, out=t, mean=mean)

    def broadcast(self, t: torch.Tensor, src: int = 0, tag: str = "", async_op: bool = False) -> Handle:
        return self._issue("broadcast", t, tag, async_op, out=t, src=src)

    def _issue(self, op: str, payload: torch.Tensor, tag: str, async_op: bool, then=None, launch_only: bool = False,
               **kw) -> Handle:
        """Run one collective and write it in the ledger (`async_op`: as launched to run behind
        compute). `launch_only`: launch it asynchronously whatever `async_op` says, for the caller
        to wait on with others (the broadcasts of one all-gather)."""
        nbytes = payload.numel() * payload.element_size()
        self.ledger.append(LedgerEntry(op, str(payload.dtype).removeprefix("torch."), nbytes, self.world_size, tag,
                                       async_op, self.group_name))
        waited = None
        if self.clock is not None:
            index, events, clock = len(self.ledger) - 1, self.ledger.events, self.clock
            events.append(("launch", index, clock()))
            waited = lambda: events.append(("wait", index, clock()))  # noqa: E731
        staged = int(nbytes * self.staging.get(op, 0.0))
        key = self.memory.hold(staged) if staged else None
        with self.memory.backend():
            handle = _Staged(self._run(op, async_op=async_op or launch_only, **kw), self.memory, key, then, waited)
        if not (async_op or launch_only):
            handle.wait()
        return handle

    def _run(self, op: str, async_op: bool, **kw) -> Handle:
        raise NotImplementedError


def backend_link(backend: str, world_size: int) -> Optional[Link]:
    """The measured rates of a backend, where a hardware profile has them: gloo's are the
    cpu-gloo profile's (this project's CPU machines). NCCL's choice never differs from the
    paper's (one bandwidth for every op), so it needs none."""
    return get_profile("cpu-gloo").link(world_size) if backend == "gloo" else None


class DistCommunicator(Communicator):
    """Real collectives on the default (or a given) torch.distributed process group.

    `link`: the rates that choose each collective; by default the backend's (`backend_link`).
    """

    def __init__(self, group=None, ledger: Optional[Ledger] = None, link: Optional[Link] | str = "backend"):
        self.group = group
        n, backend = dist.get_world_size(group), dist.get_backend(group)
        super().__init__(dist.get_rank(group), n, ledger, backend_link(backend, n) if link == "backend" else link)
        self.staging = GLOO_STAGING if backend == "gloo" else {}

    def _run(self, op: str, async_op: bool, out, inp=None, mean: bool = False, src: int = 0) -> Handle:
        g = self.group
        if op == "all_gather":
            work = all_gather_single(out, inp, group=g, async_op=async_op)
        elif op == "reduce_scatter":
            work = reduce_scatter_single(out, inp, op=self._reduce_op(mean), group=g, async_op=async_op)
        elif op == "all_reduce":
            work = dist.all_reduce(out, op=self._reduce_op(mean), group=g, async_op=async_op)
        else:  # torch names the source by its global rank, also in a subgroup
            work = dist.broadcast(out, src=src if g is None else dist.get_global_rank(g, src), group=g,
                                  async_op=async_op)
        return work if work is not None else _Done()

    @staticmethod
    def _reduce_op(mean: bool):
        return dist.ReduceOp.AVG if mean else dist.ReduceOp.SUM


def hybrid_communicators(shard_size: int, link: Optional[Link] | str = "backend", make=None
                         ) -> tuple[DistCommunicator, DistCommunicator]:
    """Hybrid sharding's two groups for this rank: its shard group (`shard_size` consecutive ranks, over
    which the stages shard) and its replica group (the ranks at the same place of every shard group, over
    which a gradient shard is all-reduced once per step). Collective: every rank makes every group, in
    the same order, as torch.distributed.new_group requires. Both write to one ledger. `make(group,
    ledger)` builds a communicator (default: a DistCommunicator on `link`; a simulated world's twins)."""
    make = make or (lambda group, ledger=None: DistCommunicator(group, ledger=ledger, link=link))
    world, rank = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"a shard group of {shard_size} ranks does not divide the world of {world}")
    shards = _consecutive_groups(shard_size)
    replicas = [dist.new_group(list(range(i, world, shard_size))) for i in range(shard_size)]
    shard_comm = make(shards[rank // shard_size])
    replica_comm = make(replicas[rank % shard_size], shard_comm.ledger)
    shard_comm.group_name, replica_comm.group_name = "shard", "replicas"
    return shard_comm, replica_comm


def _consecutive_groups(size: int) -> list:
    """Every group of `size` consecutive ranks, in order (collective: every rank makes every group)."""
    return [dist.new_group(list(range(g, g + size))) for g in range(0, dist.get_world_size(), size)]


def secondary_communicator(size: int, ledger: Ledger, make=None) -> DistCommunicator:
    """hpZ's group for this rank: the `size` consecutive ranks around it (a node, inside its shard
    group), from which stage 3's backward gathers; it writes to `ledger`. Collective, as
    `hybrid_communicators`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"an hpZ group of {size} ranks does not divide the world of {world}")
    make = make or (lambda group, ledger=None: DistCommunicator(group, ledger=ledger))
    comm = make(_consecutive_groups(size)[rank // size], ledger)
    comm.group_name = "secondary"
    return comm


class RecordingCommunicator(Communicator):
    """Records the collectives a step would issue; moves no data (for meta tensors).

    `staging` is the target backend's (a hardware profile's `collective_staging`), so
    a memory tracker counts the same staging for the same span as in a real run; `link`
    its rates, so it issues the collectives the real run issues.
    """

    def __init__(self, rank: int, world_size: int, ledger: Optional[Ledger] = None,
                 staging: Optional[dict[str, float]] = None, link: Optional[Link] = None):
        super().__init__(rank, world_size, ledger, link)
        self.staging = staging or {}

    def _run(self, op: str, async_op: bool, **kw) -> Handle:
        return _Done()
