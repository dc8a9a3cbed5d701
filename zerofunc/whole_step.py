"""The step compiled whole (`compile="whole"`): forward, backward and update as torch.compile graphs, each
collective inside them a functional collective (torch.distributed._functional_collectives) whose result is
a value, for the compiler to schedule and fuse with the compute around it.

How each stage brings a unit's weights into its block, and takes its gradient out, is one decision
(`_whole_weights`), made where the block starts:

- stage 3: `all_gather(shard)` (on gloo one op of broadcasts into one buffer: zerofunc/broadcast_gather.py),
  the block's parameters views of it through an autograd op whose backward is the reduce-scatter of the
  block's gradient, which is then the shard's gradient. The gather runs under a selective-checkpoint
  policy that recomputes it instead of saving it (SimpleFSDP's, torchtitan): backward gathers each block
  again, and no gathered block lives from forward to backward. Each gather is traced where the forward runs
  its block; zerofunc/comm_schedule.py issues it the prefetch depth ahead, forward and backward, in the order
  the forward ran the blocks, whatever order the model's code picks. A block run again later (not next) is
  gathered once: AOTAutograd's CSE merges its identical gathers, and holds it from its first run to its last
  (with `torch._functorch.config.cse` off, a probe gathered it at each run, within the bound; not done: CSE
  serves the whole graph, and its cost unmeasured).
- stage 2: the whole weights every rank keeps, through an identity whose backward is the reduce-scatter.
- stages 0-1: the whole weights, their gradient kept whole over the accumulation's micro-batches, then
  all-reduced (stage 0) or reduce-scattered (stage 1), where `reduces_in_backward` says: on a GPU in the
  boundary micro-batch's backward, the earlier ones' sum added, as each unit's backward ends (as the eager
  step reduces it), to overlap the backward of the units before it (with accumulation, the boundary's graph
  is a second one to compile); on a CPU after backward, in the update's graph, where gloo's threads would
  share the cores backward computes on (docs/BENCHMARKS.md, issue 31's eighth step: 30m stage 0 compiled
  whole 1.06-1.11x eager's step in backward, 0.90 after).

The update is two graphs around one host read, as the eager optimizer's: the reduced gradients and their
global norm (a non-finite norm skips the step, as eager's does), then the average and clipping, AdamW on
this rank's fp32 shard and, at stages 1-2, the all-gather of the new weights. The step count and the
learning rate enter as tensors, so a new step is no new graph.

The compiler's collective passes are this module's decisions too (zerofunc/compiled_graphs.py): inductor's
bucketing would merge every gather of the model into one (its cap is 2000 MB) and so hold every block
gathered at once; here gathers and reduce-scatters are bucketed up to the overlap bucket size, the
comm-reordering passes stay off, and zerofunc/comm_schedule.py moves each gather and reduce-scatter to
overlap the blocks' compute within ZeRO's bounds. What the graphs then hold is read back from them
(`WholeStep.graphs`): tests/test_whole_step.py holds stage 3 to its block and the prefetched one. Each run
of a graph writes its collectives in the communicator's ledger, tagged as the eager step tags the same bytes,
so the ledger of a step compiled whole is the eager step's (the planner's), bucketed (tests/test_whole_step.py),
but for a frozen part no gradient needs, which eager gathers again in backward with its unit (tests/test_frozen.py),
and for a block the forward runs more than once (weights shared across depth): where backward reduces, each run's
gradient is reduced here, where eager sums the runs' and reduces once (tests/test_whole_step_models.py).

Two more decisions where a block starts. Frozen parameters (requires_grad=False: LoRA's base) enter as values
with no gradient, whole at stages 0-2, gathered at stage 3 under the same recompute policy, never reduced; only
units with weights to train have a leaf and an update. A block that activation checkpointing recomputes runs
under torch's checkpoint (selective-op with its policy, zerofunc/recompute.py): the partitioner saves its
inputs and recomputes the rest in backward, and the output head its logits (zerofunc/lm_head.py).

Not yet (refused in one line): offload, hpZ, hybrid sharding, fp16 loss scaling, an fp32 reduction of 16-bit
gradients.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import checkpoint

from sim.ledger import LedgerEntry
from zerofunc.binding import installed
from zerofunc.collectives import Group, LeftOutGradient, ReducedGradient
from zerofunc.comm_schedule import overlap
from zerofunc.compiled_graphs import Collective, CompiledGraphs, with_own_code
from zerofunc.recompute import step_settings, keep_attention_and_every_second_matmul, without_cache
from zerofunc.state import OptimizerState
from zerofunc.units import reduced_dtype
from zerofunc.whole_update import adamw_then_gather, reduced_and_norm
from zerofunc.whole_weights import (Unflattened, gathered_frozen, gathered_parameters, regathered, span_in,
                                    whole_parameters)



def refusal(offload: bool, hybrid: bool, hpz: bool, fp16: bool, reduce_upcast: bool) -> Optional[str]:
    """Why a step with these levers on cannot be compiled whole yet, or None (the trainer's command line
    asks with the config's values before any rank starts, the engine with its own)."""
    levers = {"optimizer offload": offload, "hybrid sharding": hybrid, "hpZ": hpz, "fp16 loss scaling": fp16,
              "gradients reduced in fp32 (communication_data_type)": reduce_upcast}
    named = [name for name, on in levers.items() if on]
    return f"--compile whole does not support {', '.join(named)} yet: use --compile blocks" if named else None


class WholeStep:
    """One optimizer step of `engine`'s model, compiled whole. The engine's units keep the state (the
    shards, the fp32 masters, the moments); the step's graphs update them in place."""

    # tests trace with "aot_eager": the same graphs, partitioned, without codegen; ZEROFUNC_COMPILE_BACKEND=aot_eager
    # does so in the trainer's ranks (a first look at a new model, where inductor's C++ costs minutes on a CPU)
    backend = "inductor"
    # stages 0-1: whether the gradients are reduced in backward (see the module's docstring); None: on a GPU
    reduce_in_backward: Optional[bool] = None

    def __init__(self, engine):
        why = refusal(engine.offload is not None, engine.replicas is not None, engine.gathering.secondary is not None,
                      engine.state.loss_scale is not None,  # gradients reduced wider than their weights:
                      any(reduced_dtype(u.params.dtype, engine.reduce_dtype) != u.params.dtype for u in engine.units))
        if why:
            raise ValueError(why)
        self.engine, self.stage = engine, engine.stage
        group = engine.comm.group if engine.comm.group is not None else dist.group.WORLD
        self.group_name, self.world = group.group_name, engine.comm.world_size
        # each unit's gather and reduce-scatter issued as the eager communicator issues them (collectives.py)
        self.ranks = ranks = Group(group.group_name, engine.comm.rank, engine.comm.world_size)
        self.groups = {u.name: ranks.ops(u.layout.padded_numel * u.params.element_size(), engine.comm.link)
                       for u in engine.units}
        # and each frozen part's gather (stage 3; no reduction: they have no gradient)
        self.frozen_groups = {u.name: ranks.ops(u.frozen.layout.padded_numel * u.frozen.params.element_size(),
                                                engine.comm.link) for u in engine.units if u.frozen is not None}
        # the units with weights to train, as the engine's optimizer has them: a unit all frozen has no leaf
        self.trained = [u for u in engine.units if u.numel]
        # where stages 0-1 reduce (the module's docstring): in backward on a GPU, after it on a CPU
        in_backward = self.reduce_in_backward if self.reduce_in_backward is not None else \
            engine.units[0].params.device.type == "cuda"
        self.reduces_in_backward = self.stage.shard_grads or in_backward
        # each function's graphs, read as compiled and counted into the ledger as they run
        backend = os.environ.get("ZEROFUNC_COMPILE_BACKEND") or self.backend
        if backend not in ("inductor", "aot_eager"):
            raise ValueError(f"ZEROFUNC_COMPILE_BACKEND must be inductor or aot_eager, got {backend!r}")
        # the collectives moved to overlap the blocks' compute (zerofunc/comm_schedule.py): stage 3's gathers, as
        # many in flight as the eager step prefetches; the gradients' reductions, one in flight
        schedules = {"loss": functools.partial(overlap, gather_depth=engine.overlap.prefetch_depth
                                               if self.stage.shard_params else None, reductions=True)
                     if self.reduces_in_backward else None, "reduce": None,
                     "apply": functools.partial(overlap, gather_depth=None, reductions=False, gathers_in_turn=True)
                     if self.stage.shard_optimizer and not self.stage.shard_params else None}  # the new weights'
        self.graphs = {role: CompiledGraphs(backend, engine.overlap.bucket_bytes,
                                            functools.partial(self._issued, role), schedules[role])
                       for role in ("loss", "reduce", "apply")}
        compiled = lambda fn, role: torch.compile(with_own_code(fn), backend=self.graphs[role],  # noqa: E731
                                                  dynamic=False)
        # the leaves backward's gradients arrive at: the shard (stage 3; at stages 1-2, when reduced in backward,
        # a placeholder of the shard's size, since the weights the forward uses are the whole ones), else the
        # whole weights
        self.leaves = {u.name: (torch.zeros_like(u.master, dtype=u.params.dtype) if self.stage.shard_optimizer
                                and not self.stage.shard_params and self.reduces_in_backward
                                else u.params.detach()).requires_grad_() for u in self.trained}
        # stages 0-1 reduced in backward: the leaves the micro-batches before the boundary sum their gradients into
        self.accumulating = {} if self.stage.shard_grads or not self.reduces_in_backward else \
            {u.name: self.leaves[u.name] if not self.stage.shard_optimizer else u.params.detach().requires_grad_()
             for u in self.trained}
        self._accumulated: Optional[dict[str, Optional[torch.Tensor]]] = None  # the boundary's, while it runs
        self._master_spans = [span_in(u.master, u.params) for u in self.trained]
        # set in the caller's blocks while the step's forward runs (zerofunc/binding.py)
        self._forwards = {u.module: self._block_forward(u, u.module.forward, engine.checkpointing.recomputes(i))
                          for i, u in enumerate(engine.gathering.blocks)}
        self._settings = step_settings(engine.model, engine.checkpointing.on)
        self._loss = compiled(self._loss_eager, "loss")
        self._reduce = compiled(self._reduce_eager, "reduce")
        self._apply = compiled(self._apply_eager, "apply")

    def _issued(self, role: str, phase: str, collectives: list[Collective]) -> None:
        """A graph of `role` ran and issued `collectives`: into the ledger, tagged as the eager step tags them
        (zerofunc/gather.py, reduction.py, sharded_optim.py). The step waits for a scalar (the norm) at once."""
        comm = self.engine.comm
        for c in collectives:
            if role == "loss":  # a gather (or its stand-ins), else a gradient's reduction (or its stand-in)
                tag = "grads" if not c.gathers else "params.bwd" if phase == "backward" else "params.fwd"
            else:
                tag = ("grad_norm" if c.scalar else "grads") if role == "reduce" else "params.step"
            comm.ledger.append(LedgerEntry(c.op, str(c.dtype).removeprefix("torch."), c.nbytes, self.world, tag,
                                           not c.scalar, comm.group_name))

    # ---- forward and backward ------------------------------------------------------------------------
    def _whole_weights(self, unit) -> dict[str, torch.Tensor]:
        """The unit's parameters, whole: the trained ones as this stage brings them in (see the module's
        docstring), the frozen ones as values with no gradient, gathered again in backward at stage 3."""
        views = self._trained_weights(unit) if unit.numel else {}
        if unit.frozen is None:
            return views
        frozen, slots = unit.frozen, tuple((s.numel, s.shape) for s in unit.frozen.layout.slots)
        names = (s.name for s in frozen.layout.slots)
        if not self.stage.shard_params:
            return views | dict(zip(names, whole_parameters(frozen.params, slots)))
        return views | dict(zip(names, regathered(gathered_frozen, frozen.params, self.frozen_groups[unit.name], slots)))

    def _trained_weights(self, unit) -> dict[str, torch.Tensor]:
        leaf, group = self.leaves[unit.name], self.groups[unit.name]
        slots = tuple((s.numel, s.shape) for s in unit.layout.slots)
        names = (s.name for s in unit.layout.slots)
        if self.stage.shard_params:
            return dict(zip(names, regathered(gathered_parameters, leaf, group, slots)))
        if self.stage.shard_grads:
            whole = ReducedGradient.apply(leaf, unit.params, group, None, True)
        elif self._accumulated is None:  # stages 0-1 before the accumulation boundary, or reduced after backward
            whole = self.accumulating.get(unit.name, leaf)
        else:  # the boundary: the earlier micro-batches' sum added, and the whole reduced (summed at stage 0); a
            # block run again (weights shared across depth) reduces its own gradient there, the sum added once
            whole = ReducedGradient.apply(leaf, unit.params, group, self._accumulated.pop(unit.name, None),
                                          self.stage.shard_optimizer)
        return dict(zip(names, Unflattened.apply(whole, slots)))

    def _block_forward(self, unit, forward, recomputed: bool):
        cut = len(unit.name) + 1
        keeps_ops = self.engine.checkpointing.keeps_ops

        @functools.wraps(forward)
        def run(*args, **kwargs):
            weights = self._whole_weights(unit)

            def block(*args, **kwargs):
                with _reparametrize_module(unit.module, {k[cut:]: v for k, v in weights.items()}):
                    return forward(*args, **kwargs)
            if not recomputed:
                return block(*args, **kwargs)
            args, kwargs = without_cache(args, kwargs)
            return checkpoint(block, *args, use_reentrant=False, **kwargs,
                              **({"context_fn": keep_attention_and_every_second_matmul} if keeps_ops else {}))
        return run

    def _loss_eager(self, args: tuple, kwargs: dict, accumulated: Optional[dict]) -> torch.Tensor:
        from zerofunc.step import loss_of
        root = self.engine._root
        self._accumulated = dict(accumulated) if accumulated is not None else None  # each taken once
        views = self._whole_weights(root) if root is not None else {}
        loss = loss_of(functional_call(self.engine.model, views, args, kwargs, strict=False)).float()
        for name, summed in (self._accumulated or {}).items():  # units this forward did not run, used before it
            if summed is not None:
                loss = LeftOutGradient.apply(self.leaves[name], loss, self.groups[name], summed,
                                             self.stage.shard_optimizer)
        self._accumulated = None
        return loss

    def loss(self, args: tuple, kwargs: dict, accumulated: Optional[dict] = None) -> torch.Tensor:
        """The model's loss on one micro-batch, through the compiled forward (also for evaluation).
        `accumulated`, at stages 0-1: the accumulation boundary's micro-batch, whose backward reduces each
        unit's gradient with these earlier micro-batches' sums (None for a unit: none before it)."""
        with installed(self._forwards, settings=self._settings):
            return self._loss(tuple(args), dict(kwargs), accumulated)

    # ---- the step ---------------------------------------------------------------------------------------
    def __call__(self, state: OptimizerState, micro_batches: Sequence,
                 num_items: Optional[torch.Tensor]) -> tuple[OptimizerState, torch.Tensor]:
        """Forward and backward of each micro-batch, then the update: the state after it, and the mean of the
        micro-batches' losses."""
        extra = {} if num_items is None else {"num_items_in_batch": num_items}
        total = None
        for i, batch in enumerate(micro_batches):
            args, kwargs = ((), {**batch, **extra}) if isinstance(batch, dict) else (tuple(batch), extra)
            accumulated = None
            if i == len(micro_batches) - 1 and self.accumulating:  # stages 0-1: reduced in this backward
                accumulated = {name: leaf.grad for name, leaf in self.accumulating.items()}
                for leaf in self.accumulating.values():
                    leaf.grad = None
            loss = self.loss(args, kwargs, accumulated)
            (loss / len(micro_batches)).backward()
            self.graphs["loss"].backward_ran()
            total = loss.detach() if total is None else total + loss.detach()
        return self._update(state), total / len(micro_batches)

    def _update(self, state: OptimizerState) -> OptimizerState:
        opt = self.engine.optimizer
        units = self.trained
        # a unit no micro-batch's forward ran: a zero gradient, as the eager step's (zerofunc/reduction.py, left_out)
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                 for leaf in (self.leaves[u.name] for u in units)]
        for leaf in self.leaves.values():
            leaf.grad = None
        reduced, norm = self._reduce(grads)
        if not self.reduces_in_backward:  # stages 0-1 on a CPU: the reduce graph reduced them
            grads = reduced
        state, factor = opt.decide(state, float(norm))  # as the eager optimizer decides (no fp16 here)
        if factor is None:
            return state
        lr = opt.lr_schedule(state.steps) if opt.lr_schedule is not None else opt.optim.lr
        device = units[0].params.device
        self._apply(grads, *(torch.tensor(x, dtype=torch.float32, device=device)
                             for x in (factor, lr, state.steps)))
        return state

    def _reduce_eager(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        return reduced_and_norm(grads, self.trained, self.groups, self.ranks, self.stage,
                                reduce_here=not self.reduces_in_backward)

    def _apply_eager(self, grads: list[torch.Tensor], factor: torch.Tensor, lr: torch.Tensor,
                     step: torch.Tensor) -> None:
        adamw_then_gather(grads, factor, lr, step, self.trained, self._master_spans, self.groups, self.stage,
                          self.world, self.engine.optimizer.optim)
