"""Plans, and their simulation: the real training step of a stage, run on meta tensors.

`simulate(plan)` builds the same `ZeroEngine` the trainer builds, on the meta device
with a recording communicator, and runs the same `train_step`. Instruments watch it:
a memory tracker (bytes by category), a roofline (compute time), the ledger and the
alpha-beta model (communication time). Nothing here restates ZeRO's formulas; the
planner reports what the step code does.

The view taken is rank 0's. Every unit is padded so all ranks hold shards of equal
size, so rank 0 is also the worst rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from sim.hardware import Profile, get_profile
from zerofunc.config import Config
from zerofunc.lora import LoRA, apply_lora
from zerofunc.models import ModelConfig, build_model, model_config
from zerofunc.overlap import Overlap
from zerofunc.recompute import ActivationCheckpointing
from zerofunc.stages import get_stage
from zerofunc.units import PRECISIONS, check_reduce_dtype

MAX_MICRO_BATCH = 1 << 16


@dataclass(frozen=True)
class Plan:
    """What to simulate.

    `model` is a preset name (zerofunc.models.MODELS), a Hugging Face config.json path or
    model directory, a model config, or any callable that returns an `nn.Module` built on the meta device
    (its units are then `default_units`, as in the trainer, and `seq` must be given).
    Give `params` instead for model states only.

    `batch`, with a model callable: `batch(micro_batch, seq)` returns one micro-batch as the trainer feeds the
    model (a tuple of its positional arguments or a dict of its keyword ones; Whisper's `input_features=`,
    CLIP's `pixel_values=`), with values, on the host; the step is simulated on meta tensors of its shapes,
    its values known (sim/known_values.py). Without it: token ids, as `input_ids=` and `labels=` where the
    forward takes `input_ids`, else as (ids, targets).
    """

    world_size: int
    stage: int
    model: Optional[str | ModelConfig | Callable[[], nn.Module]] = "gpt2-small"
    params: Optional[int] = None
    precision: str = "bf16"
    micro_batch: int = 1
    grad_accum: int = 1        # micro-steps per optimizer step: the step simulated runs them all
    shard_group: Optional[int] = None  # hybrid sharding: ranks per shard group (None: the whole world)
    hpz: Optional[int] = None  # stage 3: backward gathers from groups of this many ranks (hpZ; None: off)
    seq: Optional[int] = None  # default: the model's context
    hardware: str = "h100-sxm"
    prefetch_depth: int = Overlap.prefetch_depth   # stage 3: blocks gathered ahead (zerofunc.overlap)
    bucket_bytes: int = Overlap.bucket_bytes       # gradient reductions in flight before waiting
    activation_checkpointing: str = "none"         # none, full or selective (zerofunc.recompute)
    ac_every: int = 2                              # selective: one block in ac_every recomputes
    offload_optimizer: bool = False                # the optimizer's state and update on the host (stages 1-3)
    reduce_dtype: Optional[str] = None             # communication_data_type: gradients reduce in it (None: precision)
    lora: Optional[LoRA] = None                    # adapters trained on the frozen model (zerofunc/lora.py)
    gpus_per_node: Optional[int] = None            # the network's devices per node (None: the profile's)
    batch: Optional[Callable[[int, int], Any]] = None  # a model callable's micro-batch, (micro_batch, seq) -> batch

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if self.grad_accum < 1:
            raise ValueError(f"gradient accumulation must be at least 1 micro-step, got {self.grad_accum}")
        if self.shard_group is not None and not (1 <= self.shard_group and self.world_size % self.shard_group == 0):
            raise ValueError(f"a shard group of {self.shard_group} ranks does not divide the world of "
                             f"{self.world_size}")
        group = self.shard_group or self.world_size
        if self.hpz is not None and not (1 <= self.hpz and group % self.hpz == 0):
            raise ValueError(f"an hpZ group of {self.hpz} ranks does not divide the shard group of {group}")
        get_stage(self.stage)
        get_profile(self.hardware)
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")
        self.overlap  # validates
        self.checkpointing  # validates
        if self.offload_optimizer and self.stage == 0:
            raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
        if self.params is not None and self.checkpointing.on:
            raise ValueError("a model of --params alone has no blocks to checkpoint")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        check_reduce_dtype(self.reduce_dtype, self.precision)
        if self.lora is not None and self.params is not None:
            raise ValueError("LoRA adapts a model's layers: give --model, not --params")
        if self.params is not None:
            if self.params < 1:
                raise ValueError(f"--params must be at least 1, got {self.params}")
            return
        if self.micro_batch < 1:
            raise ValueError(f"micro-batch must be at least 1, got {self.micro_batch}")
        if self.batch is not None and not (self.foreign and callable(self.batch)):
            raise ValueError("batch= is a callable (micro_batch, seq) -> one micro-batch, for a model given as a "
                             "callable")
        if self.foreign:
            if self.seq is None or self.seq < 1:
                raise ValueError("a model given as a callable has no known context: give seq, at least 1")
            return
        context = self.config.block_size  # resolves the name or the file: fails here, in one line
        if self.seq is not None and not 1 <= self.seq <= context:
            raise ValueError(f"a sequence of {self.seq} tokens does not fit the model's context of {context}")

    @property
    def foreign(self) -> bool:
        """The model is any nn.Module (a callable that builds it), not one of zerofunc's families."""
        return callable(self.model)

    @property
    def config(self) -> ModelConfig:
        return model_config(self.model)

    @property
    def model_name(self) -> str:
        if self.foreign:
            return getattr(self.model, "__name__", type(self.model).__name__)
        return self.model if isinstance(self.model, str) else type(self.config).__name__

    def build(self) -> nn.Module:
        """The model on the meta device: nothing is allocated."""
        with torch.device("meta"):
            if self.params is not None:
                return ParamsOnly(self.params)
            model = self.model() if self.foreign else build_model(self.config)
        if any(p.device.type != "meta" for p in model.parameters()):
            raise ValueError("the model callable must build its parameters on the meta device")
        if self.lora is not None:
            apply_lora(model, self.lora)
        return model

    @property
    def trained_numel(self) -> int:
        """The parameters the optimizer steps: all of them, or with LoRA the adapters'."""
        return sum(p.numel() for p in self.build().parameters() if p.requires_grad)

    @property
    def tokens(self) -> int:
        """Sequence length actually used."""
        return self.seq if self.seq is not None else self.config.block_size

    @property
    def profile(self) -> Profile:
        """The hardware profile, with `gpus_per_node` devices per node where given: each device keeps its
        share of the node's NICs (a DGX's one NIC per GPU stays one per GPU on a node of 4)."""
        profile = get_profile(self.hardware)
        if self.gpus_per_node is None or self.gpus_per_node == profile.devices_per_node:
            return profile
        nics = profile.nics_per_node
        return replace(profile, devices_per_node=self.gpus_per_node,
                       nics_per_node=None if nics is None else nics * self.gpus_per_node / profile.devices_per_node)

    @property
    def overlap(self) -> Overlap:
        return Overlap(self.prefetch_depth, self.bucket_bytes)

    @property
    def checkpointing(self) -> ActivationCheckpointing:
        return ActivationCheckpointing(self.activation_checkpointing, self.ac_every)

    @property
    def levers(self) -> str:
        """The memory levers in a few words: "AC full + offload", "none"."""
        on = ([f"AC {self.checkpointing.describe()}"] if self.checkpointing.on else []) + (
            ["offload"] if self.offload_optimizer else []) + ([f"hpZ {self.hpz_group}"] if self.hpz_group else [])
        return " + ".join(on) or "none"

    def zero_config(self) -> Config:
        """The DeepSpeed-style config the trainer runs this plan with (default AdamW, no clipping)."""
        return Config(stage=self.stage, micro_batch=self.micro_batch, grad_accum=self.grad_accum,
                      train_batch_size=self.micro_batch * self.world_size * self.grad_accum,
                      precision=self.precision, overlap=self.overlap, checkpointing=self.checkpointing,
                      offload_optimizer=self.offload_optimizer, shard_group=self.hybrid_group, hpz=self.hpz_group,
                      reduce_dtype=self.reduce_dtype if self.reduce_dtype != self.precision else None)

    @property
    def hybrid_group(self) -> Optional[int]:
        """The shard group's size where hybrid sharding changes anything: a group smaller than the
        world, at a stage that shards; else None."""
        s = self.shard_group
        return s if s is not None and s < self.world_size and self.stage > 0 else None

    @property
    def hpz_group(self) -> Optional[int]:
        """hpZ's group where it changes anything: stage 3, and smaller than the shard group; else None."""
        k = self.hpz
        return k if k is not None and 1 < k < (self.hybrid_group or self.world_size) and self.stage == 3 else None


class _ReadsWeightInBackward(torch.autograd.Function):
    """sum(w), but its backward reads w, as every real layer's backward reads its weights."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return w.sum(dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad.to(w.dtype).expand_as(w)


class ParamsOnly(nn.Module):
    """N parameters and no architecture: a step whose only memory is model states."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))

    def forward(self) -> torch.Tensor:
        return _ReadsWeightInBackward.apply(self.weight)


from zerofunc.plan.simulation import Simulation, simulate  # noqa: E402  (it reads Plans; the package exports both)

__all__ = ["MAX_MICRO_BATCH", "ParamsOnly", "Plan", "Simulation", "simulate"]
