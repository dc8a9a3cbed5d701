"""How the model's own forward tells the engine where a block starts and ends: the hooks ZeroEngine puts on
each block (stage 3's gather and release, binding the block's views, cutting the tape there) and the
wrapper that runs a block unwatched by the tape. The adapter item 2 of issue 31 leaves: any nn.Module's
forward drives the order of its blocks, so the engine learns of each block from the block's own call.

A mixin of ZeroEngine's, as engine_state.WholeState is: it uses the engine's `model`, `gathering`,
`memory` and `_tape` (and, to check that every rank ran the same blocks, `comm`, `replicas` and `device`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import zlib

import torch

from zerofunc.binding import bind
from zerofunc.collectives import alike_on_every_rank
from zerofunc.units import Unit


class BlockHooks:
    """ZeroEngine's block hooks (see the module's docstring)."""

    def _abandon_forward(self) -> None:
        """A forward that raised skipped its blocks' forward hooks: give the model its own parameters
        back and free what stage 3 gathered, so that the next call starts as after a finished step."""
        for unit in self.gathering.blocks:
            if unit.bound is not None:
                bind(self.model, unit.bound)
                unit.bound = None
        for unit in self.units:
            self.gathering.release(unit)
        self.gathering.start_forward()

    def _unseen_by_the_tape(self, forward):
        """A block runs as one operation of the tape's: its arguments are taken, its results tagged, and
        its inside is not watched. Watching costs the tape's Python on every torch call, which on a GPU
        step too small to hide it doubled the step (docs/CUDA.md); and dynamo does not trace a mode.
        Whether the block reads earlier tensors only through its arguments is checked on its first
        forward: what a model's code reads does not change from step to step."""
        checked = False

        @functools.wraps(forward)
        def run(*args, **kwargs):
            nonlocal checked
            if self._tape is None:
                return forward(*args, **kwargs)
            out = self._tape.unseen(forward, args, kwargs, check_reads=not checked)
            checked = True
            return out
        return run

    @staticmethod
    def _through_its_hooks(unit: Unit, forward, pre, post):
        """The block's forward called directly (`block.forward(h)`, not `block(h)`: the module's hooks do not
        run): its hooks run around it all the same. Called through the module, its pre-hook has bound it."""
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if unit.bound is not None:
                return forward(*args, **kwargs)
            pre(unit.module, args)
            out = forward(*args, **kwargs)
            post(unit.module, args, out)
            return out
        return run

    def _read_unbound(self, p: torch.Tensor) -> None:
        """The tape saw the forward take a module's own parameter: a block's, read outside the block."""
        raise ValueError(f"the forward read {next((n for n, q in self.model.named_parameters() if q is p), p.shape)} "
                         "outside its block's forward, where the engine's shards hold it: read it inside the block, or "
                         "leave the block out of unit_names= (its weights then stay in the root unit)")

    def _check_blocks_alike(self) -> None:
        """Every data-parallel rank's forward ran the same blocks in the same order: each issues its blocks'
        collectives, which pair across ranks by the order they are issued in. Checked under torch's
        TORCH_DISTRIBUTED_DEBUG=DETAIL, which checks that every rank issues collectives of the same shapes: the
        blocks being alike, ranks that ran different ones are not told apart by those. Not on meta (the
        planner's collectives move no data)."""
        if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL" or self.device.type == "meta":
            return
        ran = [u.name for u in self.gathering.order]
        fingerprint = zlib.crc32(",".join(ran).encode()) % (1 << 20)  # not hash(): each process salts str's
        if not alike_on_every_rank(self.comm, self.replicas, fingerprint, self.device):
            raise RuntimeError(f"the ranks' forwards ran different blocks (this rank's: {', '.join(ran) or 'none'}): "
                               "every rank must run the same blocks, in the same order, in each micro-step")

    def _unit_views(self, unit: Unit) -> dict[str, torch.Tensor]:
        return unit.views()

    def _gather_and_bind(self, unit: Unit):
        """The block's pre-hook. Also in backward, where a model that checkpoints its own blocks
        (`torch.utils.checkpoint`) calls the block again to recompute it: gathered again, as the engine's own
        recomputation gathers it."""
        def hook(module, args):
            if self._tape is not None:
                running = self._tape.current.unit
                if running is not None and not self.gathering.in_backward:
                    raise ValueError(f"{unit.name} ran inside {running}'s forward, and a unit cannot run inside "
                                     f"another: leave {unit.name} out of unit_names= (its weights then stay in "
                                     "the root unit)")
                self._tape.open(unit.name)
            with self._engine_work():
                if self.gathering.in_backward:
                    self.gathering.regather(unit)
                else:
                    self.gathering.enter(unit)
                unit.bound = bind(self.model, self._unit_views(unit))
        return hook

    def _unbind_and_release(self, unit: Unit):
        def hook(module, args, out):
            if self._tape is not None:
                self._tape.open(None)  # what follows the block (the next block's input, a head) is its own segment
            with self._engine_work():
                bind(self.model, unit.bound)
                unit.bound = None
                if not self.gathering.in_backward:  # a recomputation's: its backward follows, and releases it
                    self.gathering.leave(unit)
        return hook

    def _engine_work(self):
        """The hooks' gathers and bindings are the engine's, not the model's: the tape does not watch them."""
        return self._tape.paused() if self._tape is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _recomputing(self, unit: Unit):
        """Backward recomputes a checkpointed block: gather it again (stage 3) and bind its views for
        the recomputation. It stays gathered for the block's backward, which follows and releases
        it: one gather serves both (as DeepSpeed's stage3_max_reuse_distance arranges), so stage 3
        gathers each block twice per step with checkpointing as without."""
        self.memory.mark("recompute")
        self.gathering.regather(unit)
        unit.bound = bind(self.model, self._unit_views(unit))
        try:
            yield
        finally:
            bind(self.model, unit.bound)
            unit.bound = None
            self.memory.mark("backward")
