"""The ZeRO engine: one training step, shared by every stage and by the simulator.

The model is run statelessly with `torch.func.functional_call`, its parameters
replaced by views into each unit's flat buffer (`unit.weights`, an autograd leaf). The
forward is recorded on a tape (zerofunc/tape.py) cut where each block starts and ends,
and backward is a loop over its segments, last first: each gives its block's whole gradient
as a value, the moment backward is done with the block, and the stage decides what to
do with it (all-reduce, reduce-scatter, or keep it for later); the root unit's gradient
(embeddings, final norm, a tied head) is complete after the first segment.

Stage 3 additionally frees each gathered buffer after the unit's forward and gathers
it again on demand in backward (zerofunc/gather.py). Gradients come from torch
autograd; torch.func's transforms return zeros through collectives.

Two memory levers are decisions here too, not forks: activation checkpointing wraps a
block's forward so that backward recomputes it (zerofunc/recompute.py), and optimizer
offload keeps the optimizer's state on the host, where each reduced gradient shard
goes the moment it exists (zerofunc/offload.py).

Communication overlaps compute (see zerofunc/overlap.py): stage 3 gathers the next
blocks while one computes, and every stage launches a block's gradient reduction as
soon as its backward is done, waiting for it only when the in-flight bytes exceed the
bucket size or backward has finished.

The same code runs on meta tensors with a `RecordingCommunicator` to simulate a step.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn
from torch.func import functional_call

from zerofunc import frozen_source
from zerofunc.binding import installed, with_ties
from zerofunc.block_hooks import BlockHooks
from zerofunc.collectives import data_parallel_sum
from zerofunc.comm import Communicator
from zerofunc.config import COMPILE_MODES
from zerofunc.engine_state import WholeState
from zerofunc.gather import UnitGathering
from zerofunc.loss_scale import LossScaler
from zerofunc.offload import OptimizerOffload
from zerofunc.optim import AdamWConfig
from zerofunc.overlap import Overlap
from zerofunc.recompute import ActivationCheckpointing, checkpointed, step_settings
from zerofunc.reduction import GradientReduction
from zerofunc.sharded_optim import ShardedAdamW
from zerofunc.stages import Stage
from zerofunc.state import OptimizerState
from zerofunc.tape import Tape
from sim.memory import NoMemoryTracking
from zerofunc.lora import weights_dtype
from zerofunc.units import PRECISIONS, InitFn, Unit, check_reduce_dtype, materialize, partition
from zerofunc.whole_step import WholeStep


class ZeroEngine(BlockHooks, WholeState):
    """Trains `model` with ZeRO `stage` over `comm`'s ranks.

    `model` may live on the meta device: only the shapes of its parameters are used.
    `unit_names` are the submodules gathered one at a time under stage 3; their
    parameters, and separately all the others, each form one flat unit.
    `precision` is the dtype of parameters, gradients and collectives ("fp32", "bf16",
    "fp16"); the optimizer always works on fp32 masters.
    `memory` (a sim.memory.MemoryTracker) is told what each allocation is for.
    `grad_accum` micro-steps make one optimizer step; `clip` > 0 clips the global
    gradient norm; `loss_scaler` (a LossScaler, for fp16) scales the loss in backward.
    `overlap` sets the prefetch depth and the bucket size (zerofunc.overlap.Overlap).
    `checkpointing` says which blocks recompute their forward in backward; `offload_optimizer`
    keeps the optimizer's state in host memory and updates it on the CPU (stages 1-3).
    `replicas` (hybrid sharding): `comm` is then this rank's shard group, over which the stage shards,
    and `replicas` the group of ranks holding the same shard in the other shard groups: each
    gradient shard is averaged over it once per optimizer step, at the accumulation boundary.
    `secondary` (hpZ, stage 3): k consecutive ranks inside the shard group, from which backward
    gathers the weights each rank kept 1/k of after forward (zerofunc.gather).
    `reduce_dtype` (DeepSpeed's communication_data_type, FSDP2's reduce_dtype): the dtype gradients are
    accumulated across micro-steps, reduced over the ranks and handed to the optimizer in; by default
    the compute dtype's. "fp32" under bf16 or fp16 sums in fp32 what 16-bit sums would round at every add.
    """

    def __init__(self, model: nn.Module, stage: Stage, comm: Communicator, optim: AdamWConfig,
                 device: torch.device | str = "cpu", init: Optional[InitFn] = None,
                 unit_names: Optional[list[str]] = None, precision: str = "fp32", memory=None,
                 grad_accum: int = 1, clip: float = 0.0, loss_scaler: Optional[LossScaler] = None,
                 overlap: Overlap = Overlap(), compile: bool | str = False,
                 checkpointing: ActivationCheckpointing = ActivationCheckpointing(), offload_optimizer: bool = False,
                 replicas: Optional[Communicator] = None, secondary: Optional[Communicator] = None,
                 reduce_dtype: Optional[str] = None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        check_reduce_dtype(reduce_dtype, precision)
        self.reduce_dtype = PRECISIONS[reduce_dtype or precision]
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be False, True (\"blocks\") or \"whole\", got {compile!r}")
        if grad_accum < 1 or clip < 0:
            raise ValueError(f"need grad_accum >= 1 and clip >= 0, got {grad_accum} and {clip}")
        if offload_optimizer and not stage.shard_optimizer:
            raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps no optimizer shard)")
        self.grad_accum, self.checkpointing = grad_accum, checkpointing
        # the imperative API's state (backward(), step()): micro-steps since the last optimizer step, and the
        # optimizer's state, replaced by each step (zerofunc/step.py's `step` takes it as an argument)
        self.micro_step = 0
        self.state = OptimizerState(loss_scale=loss_scaler)
        self.model, self.stage, self.comm, self.optim, self.overlap = model, stage, comm, optim, overlap
        if replicas is not None and not stage.shard_optimizer:
            raise ValueError("hybrid sharding shards within a group: it needs ZeRO stage 1, 2 or 3")
        self.replicas = replicas if replicas is not None and replicas.world_size > 1 else None
        self.device = torch.device(device)
        self.memory = memory if memory is not None else NoMemoryTracking()
        comm.memory = self.memory  # the backend's staging during collectives counts too
        for group in (self.replicas, secondary):
            if group is not None:
                group.memory = self.memory
        if unit_names is None:
            unit_names = model.shard_units() if hasattr(model, "shard_units") else []
        self.offload = OptimizerOffload(self.device, self.memory) if offload_optimizer else None
        self.reduction = GradientReduction(stage, comm, self.replicas, self.offload, self.memory, self.reduce_dtype,
                                           overlap.bucket_bytes)
        compute = PRECISIONS[precision]
        self.units = [materialize(name, module, named, comm.world_size, comm.rank, stage, self.device, init,
                                  compute, self.memory, self.offload, self.reduce_dtype,
                                  weights_dtype([n for n, p in named if p.requires_grad], compute))
                      for name, module, named in partition(model, unit_names)]
        # where the frozen weights were read from, if from files: a checkpoint records those instead of saving the
        # weights (zerofunc/frozen_source.py); None when there are none, or they came from anywhere else
        self.frozen_source = frozen_source.locate(
            init, [s.name for u in self.units if u.frozen is not None for s in u.frozen.layout.slots])
        # the model's parameters, frozen ones too (a unit's `numel` counts its trainable ones)
        self.numel = sum(u.numel + (u.frozen.layout.numel if u.frozen is not None else 0) for u in self.units)
        # the units with parameters to train: a unit whose parameters are all frozen gets no gradient, no step
        trained = [u for u in self.units if u.numel]
        self.optimizer = ShardedAdamW(trained, stage, comm, optim, self.memory, clip, overlap.bucket_bytes,
                                      self.offload)
        self._tape: Optional[Tape] = None  # the last forward's, until its backward
        self._unit_named = {u.name: u for u in self.units}
        self._root = next((u for u in self.units if u.name == ""), None)  # parameters outside any block
        self.gathering = UnitGathering(self.units, stage, comm, overlap, self.memory, secondary)
        if checkpointing.on and not self.gathering.blocks:
            raise ValueError("activation checkpointing recomputes blocks, and this model has none: give unit_names")
        self.whole: Optional[WholeStep] = None  # the step compiled whole, which brings in the blocks' weights itself
        if compile == "whole":
            self.whole = WholeStep(self)
            return
        for unit in self.units:  # the gradient comes as a value from engine.backward, never into .grad
            unit.weights.register_post_accumulate_grad_hook(_outside_the_engine)
        # a compiled backward saves its weights past the pack hook: stage 3 gathers such a block again
        # before its segment is differentiated
        self._regather_before_backward = compile and stage.shard_params
        if self._regather_before_backward:  # stage 3's blocks compiled: their runs call the pack hook
            self.gathering.keep_hooks_from_dynamo()
        # what the engine's forward sets in the caller's modules while it runs (zerofunc/binding.py)
        self._forwards, self._pre_hooks, self._post_hooks = {}, {}, {}
        for i, unit in enumerate(self.gathering.blocks):
            pre, post = self._gather_and_bind(unit), self._unbind_and_release(unit)
            self._pre_hooks[unit.module], self._post_hooks[unit.module] = pre, post
            forward = unit.module.forward
            if compile:  # the block's compute only: its hooks gather, bind and release outside the graph
                forward = torch.compile(forward)
            forward = self._unseen_by_the_tape(forward)
            if checkpointing.recomputes(i):
                forward = checkpointed(forward, lambda u=unit: u.bound is not None, lambda u=unit: self._recomputing(u),
                                       checkpointing.keeps_ops)
            self._forwards[unit.module] = self._through_its_hooks(unit, forward, pre, post)
        self._settings = step_settings(model, checkpointing.on)

    # ---- forward -----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run the model's forward on this rank's batch, with the units' weights.

        Weights enter as views of each unit's leaf (`unit.weights`). A block's views are
        bound by its forward pre-hook, just before it runs (under stage 3, just after it
        is gathered), which also starts the block's segment of the tape: the hooks are the
        adapter through which the model's own forward, not the engine, says where blocks
        start. They, and the blocks' forwards the engine runs (unwatched by the tape, compiled,
        checkpointed), are in the caller's modules for this call and its backward only (zerofunc/binding.py).
        The root unit is bound (and under stage 3 gathered) for the whole call.
        """
        if self.whole is not None:
            if torch.is_grad_enabled():
                raise RuntimeError("this engine compiles the step whole: train with zerofunc.step.train_step")
            return self.whole.loss(args, kwargs)
        self.memory.mark("forward")
        views: dict[str, torch.Tensor] = {}
        if self._root is not None:
            self.gathering.gather(self._root, "params.fwd")
            views = with_ties(self.model, self._unit_views(self._root))
        self._tape = Tape(_outside_the_engine, self._read_unbound) if torch.is_grad_enabled() else None  # none to cut
        self.gathering.start_forward()
        try:
            with self.memory.category("activations"), contextlib.ExitStack() as stack:
                stack.enter_context(installed(self._forwards, self._pre_hooks, self._post_hooks, self._settings))
                if self.stage.shard_params:
                    stack.enter_context(self.gathering.saved_tensors_hooks())
                if self._tape is not None:
                    stack.enter_context(self._tape)
                out = functional_call(self.model, views, args, kwargs, tie_weights=False)  # views: with_ties
            self.gathering.end_forward()
            self._check_blocks_alike()  # under TORCH_DISTRIBUTED_DEBUG=DETAIL; before backward's first collective
        except BaseException:
            self._abandon_forward()
            raise
        if self._root is not None:
            self.gathering.release(self._root, after_forward=True)
        return out

    # ---- backward ----------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's `engine.backward(loss)`: backward of one micro-step, the loss divided by the
        accumulation count (and multiplied by the fp16 loss scale), so gradients sum to the big batch's.
        The engine counts the micro-steps for this call and `step()`: the imperative API's state
        (zerofunc/step.py's `step` takes its state as an argument instead)."""
        self.differentiate(loss, self.state.loss_multiplier / self.grad_accum,
                           boundary=self.micro_step + 1 == self.grad_accum)
        self.micro_step += 1

    def differentiate(self, loss: torch.Tensor, scale: float, boundary: bool) -> None:
        """Backward of the last forward's `loss`, times `scale`; `boundary`: the step's last micro-step,
        after which stages 0-1 reduce (the others reduce every micro-step).

        The forward's tape is differentiated segment by segment, last first; each block's
        gradient is handed to the stage's reduction as soon as its (first run's) segment is done, the
        root's (used in the first and, for a head, the last segments) after the first."""
        tape, self._tape = self._tape, None
        if tape is None:
            raise RuntimeError("engine.backward(loss) with no forward through the engine since the last backward")
        self.memory.mark("backward")
        tape.seed(loss, torch.full_like(loss, scale))
        root = self._root
        # a block the forward ran more than once (weights shared across depth, as ALBERT's) is done with at its
        # first run's segment: its gradient is summed until then, and reduced once, as the root's is
        first_run = {segment.unit: segment.index for segment in reversed(tape.segments)}
        held: dict = {}  # a block's name (the root's: None) -> its gradient over the segments differentiated so far
        self.gathering.start_backward([self._unit_named[s.unit] for s in reversed(tape.segments) if s.unit is not None])
        # the blocks' hooks and forwards also while backward runs: a model that checkpoints its own blocks calls them
        with self.memory.category("activations"), installed(self._forwards, self._pre_hooks, self._post_hooks,
                                                            self._settings):
            for segment in reversed(tape.segments):
                unit = self._unit_named[segment.unit] if segment.unit is not None else None
                if unit is not None:
                    self.gathering.enter_backward(unit, gather=self._regather_before_backward)
                owners = [(name, u) for name, u in ((segment.unit, unit), (None, root)) if u is not None]
                for (name, _), g in zip(owners, tape.grad(segment, [u.weights for _, u in owners])):
                    if g is not None:
                        held[name] = held[name].add_(g) if name in held else g
                if unit is not None and segment.index == first_run[unit.name]:
                    self._unit_done(unit, held.pop(unit.name, None), boundary)
                elif unit is not None:
                    self.gathering.leave(unit)  # backward reaches its earlier run later
            if root is not None:
                self._unit_done(root, held.pop(None, None), boundary)
            for unit in (u for u in self.gathering.blocks if boundary and u.name not in first_run):  # not run
                self._unit_done(unit, None, boundary)
        self.reduction.drain()
        self.gathering.end_backward()

    def _unit_done(self, unit: Unit, grad: Optional[torch.Tensor], boundary: bool) -> None:
        """Backward is done with the unit: reduce its gradient of this micro-step as the stage says
        (zerofunc/reduction.py), and release its weights (stage 3). A unit whose weights are all frozen has no
        gradient, and is released all the same; one this micro-step did not reach is left out of it."""
        if grad is not None:
            self.reduction.add(unit, grad, boundary)
        elif boundary and unit.numel:
            self.reduction.left_out(unit)
        self.gathering.leave(unit)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each train on their own micro-batches: all of them, whether or not the stage
        shards over all of them."""
        return self.comm.world_size * (self.replicas.world_size if self.replicas is not None else 1)

    def reduce_data_parallel(self, t: torch.Tensor, tag: str, mean: bool = True) -> None:
        """All-reduce `t` over every data-parallel rank: the shard group, then the replicas (equal
        groups, so the mean of their means is the mean)."""
        data_parallel_sum(self.comm, self.replicas, t, tag, mean=mean)

    # ---- optimizer ---------------------------------------------------------------
    def step(self, lr: Optional[float] = None) -> bool:
        """DeepSpeed's `engine.step()`: at an accumulation boundary, the sharded optimizer's update of
        the engine's state (`self.state`); before one, nothing.

        Returns whether the parameters changed (False before a boundary, and when fp16
        gradients overflowed on any rank).
        """
        if self.micro_step == 0:
            raise RuntimeError("step() with no engine.backward(loss) since the last step: nothing to update")
        if self.micro_step < self.grad_accum:
            return False
        self.micro_step = 0
        before, self.state = self.state, self.update(self.state, lr)
        return self.state.steps > before.steps

    def update(self, state: OptimizerState, lr: Optional[float] = None) -> OptimizerState:
        """The optimizer's update from the reduced gradients: `state` in, the state after it out."""
        self.memory.mark("step")
        return self.optimizer.step(state, lr)


def _outside_the_engine(leaf: torch.Tensor) -> None:
    """loss.backward() reached a unit's weights, or a leaf of the tape's (the last segment's, which is all
    a plain backward reaches): the gradient would be kept but never reduced or stepped."""
    leaf.grad = None
    raise RuntimeError("backward ran outside the engine: call engine.backward(loss), not loss.backward()")
