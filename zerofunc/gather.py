"""Stage 3's weights, unit by unit: gathered just before use, prefetched ahead, released after.

A rank keeps only its shard of each unit (`unit.params`); `unit.full` is the buffer the
forward takes views of, whose storage exists only while the unit is gathered. Release
frees that storage in place (`untyped_storage().resize_(0)`, as PyTorch FSDP1 does), so
every view of it stays valid and is filled again by the next gather.

Backward needs a block's weights again. Eager autograd unpacks them through the
saved-tensor hooks below, which notice a weight of a released unit and gather it; a
compiled block saves its weights where those hooks cannot see, so the engine gathers it
before differentiating its segment instead (`regather`).

While a block computes, the `Overlap.prefetch_depth` blocks that run after it are gathered. Any
nn.Module's forward may run its blocks in any order, one more than once (weights shared across
depth), one not at all: forward predicts from the order the blocks ran in the last forward (at
first, the modules' order), as DeepSpeed's stage 3 traces it, and releases a prefetched block
that is no longer predicted, so a wrong guess costs a gather, never memory; backward knows its
order, the forward's reversed. A block that runs again next is kept, not released and gathered.

hpZ (ZeRO++'s `zero_hpz_partition_size`, FSDP2's `reshard_after_forward=k`): where a
`secondary` group of k consecutive ranks is given (a node, inside the shard group), forward's
release keeps this rank's 1/k of the weights it has just used, and backward gathers them
again from those k ranks, not from the whole shard group: 2Ψ/k more memory from forward to
backward, and backward's gathers stay inside the node. Forward always gathers from the
shards the optimizer updates, so a secondary copy is never read after a step.

Under stages 0-2 every unit is always gathered (`unit.full` is the whole parameter
buffer), and every method here does nothing.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from zerofunc.collectives import gather_weights
from zerofunc.comm import AllHandles, Communicator
from zerofunc.layout import shard
from zerofunc.overlap import Overlap
from zerofunc.stages import Stage
from zerofunc.units import Unit


class _SavedUnitWeight:
    """What the pack hook saves instead of a weight: the weight plus its unit."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: Unit, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


class UnitGathering:
    """Gathers, prefetches and releases the units of one engine; `blocks` in the modules' order."""

    def __init__(self, units: list[Unit], stage: Stage, comm: Communicator, overlap: Overlap, memory,
                 secondary: Optional[Communicator] = None):
        self.stage, self.comm, self.overlap, self.memory = stage, comm, overlap, memory
        self.secondary = secondary if stage.shard_params else None  # hpZ's group: a node inside the shard group
        self.units = units
        self._hooks = (self._pack, self._unpack)  # autograd's saved-tensor hooks (keep_hooks_from_dynamo)
        self.blocks = [u for u in units if u.name != ""]
        self._block_index = {id(u): i for i, u in enumerate(self.blocks)}
        self.order = list(self.blocks)  # the blocks in the order the last forward ran them
        self._runs: list[Unit] = []  # this forward's blocks so far; in backward, the order it reaches them in
        self._at = -1  # backward: the position in `_runs` of the block it differentiates
        # the blocks predicted to run next: the prefetch depth's (gathered ahead, or kept), and at least one, so
        # that a block that runs again next is kept gathered at any depth
        self._ahead: list[Unit] = []
        self._window = max(1, overlap.prefetch_depth)
        self._forward = True
        # a weight's view: its base is the unit's leaf, or a frozen part's buffer
        self._by_buffer = {id(u.weights): u for u in units} | {id(u.frozen.full): u for u in units
                                                                if u.frozen is not None and stage.shard_params}
        # a tape's leaf aliasing a weight (zerofunc/tape.py) has no base: found by its storage, which a
        # release keeps, only freeing its bytes
        self._by_storage = {u.full.untyped_storage()._cdata: u for u in units if u.full is not u.params}

    def gather(self, unit: Unit, tag: str, prefetch: bool = False) -> None:
        """Make the unit's whole weights available; a prefetch only starts the gather, a use waits for it.
        A unit's trainable and frozen parameters are two buffers, gathered together."""
        if not unit.gathered:
            handles = []
            for full, mine, node_copy in self._buffers(unit):
                full.untyped_storage().resize_(full.numel() * full.element_size())
                self.memory.resized(full)
                if not full.numel():
                    continue
                if node_copy is not None and tag == "params.bwd":  # hpZ: from the node's copies
                    handles.append(gather_weights(self.secondary, full, node_copy, tag, async_op=prefetch))
                else:  # forward reads the shards the optimizer updates
                    handles.append(gather_weights(self.comm, full, mine, tag, async_op=prefetch))
            unit.gathering, unit.gathered = (AllHandles(handles) if prefetch else None), True
            if not (prefetch and tag == "params.bwd"):  # hpZ's copies, read until the prefetch is waited for
                self._drop_node_copies(unit)
        if not prefetch and unit.gathering is not None:
            self._finish(unit)

    @staticmethod
    def _parts(unit: Unit):
        """The unit's trainable part (the unit itself), then its frozen one: each a gather buffer `full`, a shard
        `params` and hpZ's copy `secondary`, gathered, released and copied alike."""
        yield unit
        if unit.frozen is not None:
            yield unit.frozen

    @classmethod
    def _buffers(cls, unit: Unit):
        """(gather buffer, shard, hpZ's copy) of each part of the unit."""
        for part in cls._parts(unit):
            yield part.full, part.params, part.secondary

    @classmethod
    def _drop_node_copies(cls, unit: Unit) -> None:
        for part in cls._parts(unit):
            part.secondary = None

    def _finish(self, unit: Unit) -> None:
        """Wait for the unit's gather; what it read from (hpZ's copy) may then go."""
        unit.gathering.wait()
        unit.gathering = None
        self._drop_node_copies(unit)

    # ---- the order blocks run in: forward ----------------------------------------------------------------
    def start_forward(self) -> None:
        self._runs, self._at, self._ahead, self._forward = [], -1, [], True

    def enter(self, unit: Unit) -> None:
        """A block's forward begins: gather it, and prefetch the blocks that followed it in the last forward."""
        self._runs.append(unit)
        self.gather(unit, "params.fwd")
        if self.stage.shard_params:
            self._prefetch(unit, self._predicted(unit), "params.fwd")

    def _predicted(self, unit: Unit) -> list[Unit]:
        """The blocks that followed `unit` in the last forward, from its run at this run's position (or, the
        order having changed, its nearest run after it, else its first); the modules' order for a block the last
        forward did not run."""
        order, here = self.order, len(self._runs) - 1
        at = next((i for i in itertools.chain(range(here, len(order)), range(min(here, len(order))))
                   if order[i] is unit), None)
        if at is None:
            order, at = self.blocks, self._block_index[id(unit)]
        return order[at + 1:at + 1 + self._window]

    def leave(self, unit: Unit) -> None:
        """Forward or backward is done with a block (or the root unit): release it, unless it runs next."""
        if unit not in self._ahead:
            self.release(unit, after_forward=self._forward)

    def end_forward(self) -> None:
        """The forward has run: its order predicts the next one's, and what it prefetched in vain goes."""
        self.order = self._runs or self.order
        self._prefetch(None, [], "params.fwd")

    # ---- backward -----------------------------------------------------------------------------------------
    @property
    def in_backward(self) -> bool:
        return not self._forward

    def start_backward(self, runs: list[Unit]) -> None:
        """Backward reaches the forward's blocks in `runs`' order (the forward's, reversed)."""
        self._runs, self._at, self._ahead, self._forward = runs, -1, [], False

    def enter_backward(self, unit: Unit, gather: bool) -> None:
        """Backward reaches a block's next run: its weights are gathered now with `gather`, else when its segment
        unpacks them (`regather`)."""
        self._at += 1
        assert self._runs[self._at] is unit, (unit.name, self._at)
        if gather:
            self.regather(unit)

    def regather(self, unit: Unit) -> None:
        """Backward needs the unit's weights again (to recompute its forward, or for its own backward):
        gather it, and start on the blocks backward reaches after it."""
        self.gather(unit, "params.bwd")
        if self.stage.shard_params and unit.name != "":
            self._prefetch(unit, self._runs[self._at + 1:self._at + 1 + self._window], "params.bwd")

    def _prefetch(self, unit: Optional[Unit], ahead: list[Unit], tag: str) -> None:
        """`unit` computes, and `ahead` run next: start gathering them; a block gathered ahead that no longer
        is goes (one that ran in this forward keeps hpZ's part for backward)."""
        for stale in self._ahead:
            if stale is not unit and stale not in ahead:
                self.release(stale, after_forward=self._forward and stale in self._runs)
        self._ahead = ahead
        for nxt in ahead[:self.overlap.prefetch_depth]:
            if nxt is not unit:
                self.gather(nxt, tag, prefetch=True)

    def release(self, unit: Unit, after_forward: bool = False) -> None:
        """Free a gathered unit's storage; only stage 3 ever gathers, so elsewhere this does nothing.
        With hpZ, a release `after_forward` that backward will follow first keeps this rank's part."""
        if unit.gathered and self.stage.shard_params:
            if unit.gathering is not None:  # never free a buffer a collective is still writing
                self._finish(unit)
            if after_forward and self.secondary is not None and torch.is_grad_enabled():
                with self.memory.category("params"):
                    for part in self._parts(unit):
                        part.secondary = shard(part.full, self.secondary.rank, self.secondary.world_size).clone()
            for full, _, _ in self._buffers(unit):
                full.untyped_storage().resize_(0)
                self.memory.resized(full)
            unit.gathered = False

    def end_backward(self) -> None:
        """Backward has run: nothing stays gathered (a block kept for a run backward did not reach), nor a copy hpZ
        kept for a backward that did not need it, and nothing of the step stays but the order it learned."""
        for unit in self.blocks:
            self.release(unit)
        for unit in self.units:
            self._drop_node_copies(unit)
        self.start_forward()

    def saved_tensors_hooks(self):
        """Autograd's pack/unpack hooks that gather a released unit when backward unpacks one of its weights."""
        return torch.autograd.graph.saved_tensors_hooks(*self._hooks)

    def keep_hooks_from_dynamo(self) -> None:
        """For compiled blocks. Autograd's C++ engine calls the hooks also from within a compiled block's run,
        where dynamo would take each for a frame to compile: once per saved tensor's dtype and shape, to its
        recompile limit (8; the GPU runs' compiled checks hit it). A dict lookup gains nothing compiled; torch's
        checkpoint hook is kept from dynamo the same way (pytorch/pytorch#178330). Not done for an eager
        engine: `torch.compiler.disable` loads dynamo, and with it triton (tests/test_aot.py)."""
        self._hooks = (torch.compiler.disable(self._pack), torch.compiler.disable(self._unpack))

    def _pack(self, t: torch.Tensor):
        if t._base is not None:
            unit = self._by_buffer.get(id(t._base))
        elif t.grad_fn is None and t.requires_grad:  # only leaves: most saved tensors are neither
            unit = self._by_storage.get(t.untyped_storage()._cdata)
        else:
            unit = None
        return t if unit is None else _SavedUnitWeight(unit, t)

    def _unpack(self, saved):
        if isinstance(saved, _SavedUnitWeight):
            self.regather(saved.unit)
            return saved.tensor
        return saved
