"""The DeepSpeed-style JSON config, read into a plain dataclass.

The same file a DeepSpeed user already has works here. Keys zerofunc implements are
read; known DeepSpeed keys it does not need (bucket sizes, ...) are listed in
`Config.ignored` for one warning; a known key asking for what zerofunc does not do
(NVMe or parameter offload, activations checkpointed to the CPU) is an error, as is
anything unknown, naming the key. Errors are `ConfigError`, one line each.

The memory levers: `zero_optimization.offload_optimizer.device: "cpu"` (or DeepSpeed's
older `cpu_offload: true`) keeps the optimizer on the host; an `activation_checkpointing`
section turns checkpointing on, "full" unless its `mode` says "selective" (with `every`)
or "none". DeepSpeed leaves the choice of what to checkpoint to the model's code; those
two keys are zerofunc's, for any model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from zerofunc import config_sections as sections
from zerofunc.config_sections import IGNORED_TOP, IGNORED_ZERO, ConfigError
from zerofunc.loss_scale import LossScaler
from zerofunc.optim import AdamWConfig
from zerofunc.overlap import Overlap
from zerofunc.recompute import ActivationCheckpointing
from zerofunc.schedule import Schedule
from zerofunc.units import PRECISIONS, check_reduce_dtype


# Bounds on what a run may ask for, orders of magnitude past any real run: beyond them a run would
# exhaust memory or hang on launch, so the command line refuses them up front, in one line.
MAX_MICRO_BATCH_TOKENS = 2**24  # tokens per rank per micro-step (micro-batch x seq)
MAX_GLOBAL_BATCH = 2**24        # sequences per optimizer step: each micro-step draws all their offsets anew
MAX_PREFETCH_DEPTH = 1024       # stage 3 blocks gathered ahead of the one computing: more than any model has
MAX_RANKS_PER_CORE = 4          # ranks on a CPU (each a process with its own torch) per core
MAX_COMM_TIMEOUT_S = 7 * 24 * 3600  # a week: no bound at all in practice, and far from timedelta's overflow
MAX_BUCKET_MB = 2**20           # --bucket-mb: a TiB of gradient reductions in flight, more than any model has
MAX_SEED = 2**22                # --seed: a sample's id is seed << 40 plus its row of the run, in 64 bits


COMPILE_MODES = (False, True, "blocks", "whole")  # True is "blocks"


def compile_mode(given: bool | str | None, configured: bool | str | None, device_type: str) -> bool | str:
    """What to compile: the caller's choice (a flag, an argument), else the config's `compile` key, else
    each block on CUDA and nothing on CPU (where inductor emits C++ and a first compile outlasts a short run)."""
    chosen = given if given is not None else configured
    if chosen is None:
        return "blocks" if device_type == "cuda" else False
    return "blocks" if chosen is True else chosen


@dataclass(frozen=True)
class Config:
    stage: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    train_batch_size: int = 1
    precision: str = "fp32"
    clip: float = 0.0
    optimizer: AdamWConfig = AdamWConfig()
    fp16: dict = field(default_factory=dict)
    schedule: Optional[Schedule] = None
    overlap: Overlap = Overlap()
    checkpointing: ActivationCheckpointing = ActivationCheckpointing()
    offload_optimizer: bool = False
    shard_group: Optional[int] = None  # hybrid sharding: ranks per shard group (None: the whole world)
    hpz: Optional[int] = None  # stage 3: ranks backward gathers from, each keeping 1/hpz after forward (None: off)
    comm_timeout: float = 300.0  # seconds a collective waits for the other ranks (zerofunc's key; DeepSpeed has none)
    reduce_dtype: Optional[str] = None  # communication_data_type: gradients' reduction dtype (None: the compute dtype)
    compile: bool | str | None = None  # zerofunc's key: false, "blocks" (true) or "whole" (None: blocks on CUDA only)
    ignored: tuple[str, ...] = ()

    def loss_scaler(self) -> Optional[LossScaler]:
        """A fresh scaler for fp16 (None otherwise); loss_scale > 0 means a static scale."""
        if self.precision != "fp16":
            return None
        f = self.fp16
        static = f.get("loss_scale", 0)
        return LossScaler(scale=static or 2.0 ** f.get("initial_scale_power", 16), dynamic=not static,
                          window=f.get("loss_scale_window", 1000), hysteresis=f.get("hysteresis", 2),
                          min_scale=f.get("min_loss_scale", 1))

    def lr(self, step: int) -> float:
        return self.schedule.lr(step, self.optimizer.lr) if self.schedule else self.optimizer.lr


def read(source: dict | str | Path) -> dict:
    """The raw config: a dict as is, or a JSON file."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text, so not JSON") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except ValueError as e:  # a name no file can have: a NUL character
        raise ConfigError(f"cannot read config file {str(path)!r}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def parse(source: dict | str | Path, world_size: int) -> Config:
    raw = read(source)
    ignored: list[str] = []
    known = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "zero_optimization", "fp16", "bf16", "gradient_clipping", "optimizer", "scheduler",
             "activation_checkpointing", "comm_timeout", "communication_data_type", "compile"}
    sections.check_keys(raw, known, IGNORED_TOP, "", ignored)

    zero = sections.section_of(raw, "zero_optimization")
    sections.check_keys(zero, {"stage", "overlap_comm", "reduce_bucket_size", "offload_optimizer", "offload_param",
                               "cpu_offload", "shard_group_size", "mics_shard_size",
                               "zero_hpz_partition_size"},
                        IGNORED_ZERO - {"mics_shard_size"}, "zero_optimization.", ignored)
    stage = sections.number(zero, "stage", 0, "zero_optimization.stage", int)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    offload = sections.offload(zero, stage, ignored)
    shard_group = sections.shard_group(zero, world_size)
    hpz = sections.hpz(zero, stage, shard_group or world_size, ignored)

    fp16, bf16 = sections.fp16(raw, ignored), sections.section_of(raw, "bf16")
    sections.check_keys(bf16, {"enabled"}, {"immediate_grad_update", "check_grad_overflow"}, "bf16.", ignored)
    bf16_on = sections.boolean(bf16, "enabled", False, "bf16.enabled")
    if fp16["enabled"] and bf16_on:
        raise ConfigError("fp16 and bf16 are both enabled; enable at most one")
    precision = "fp16" if fp16["enabled"] else "bf16" if bf16_on else "fp32"

    clip = sections.number(raw, "gradient_clipping", 0.0, "gradient_clipping", float)
    if clip < 0:
        raise ConfigError(f"gradient_clipping must be >= 0, got {clip}")
    comm_timeout = sections.number(raw, "comm_timeout", 300.0, "comm_timeout", float)
    if not 0 < comm_timeout <= MAX_COMM_TIMEOUT_S:
        raise ConfigError(f"comm_timeout must be a number of seconds in (0, {MAX_COMM_TIMEOUT_S}], got {comm_timeout}")
    reduce_dtype = raw.get("communication_data_type")
    if reduce_dtype is not None:
        if reduce_dtype not in PRECISIONS:
            raise ConfigError(f"communication_data_type must be one of {', '.join(PRECISIONS)} or null, got "
                              f"{json.dumps(reduce_dtype)}")
        try:
            check_reduce_dtype(reduce_dtype, precision)
        except ValueError as e:
            raise ConfigError(f"communication_data_type: {e}") from None
    compile = raw.get("compile")
    if compile is not None and compile not in COMPILE_MODES:
        raise ConfigError(f'compile must be false, true ("blocks": each block compiled) or "whole" (the step compiled '
                          f'whole), got {json.dumps(compile)}')
    mb, gas, tbs = _batch_triple(raw, world_size)
    try:
        return Config(stage=stage, micro_batch=mb, grad_accum=gas, train_batch_size=tbs, precision=precision,
                      clip=clip, optimizer=sections.optimizer(raw, ignored), fp16=fp16,
                      schedule=sections.schedule(raw), overlap=sections.overlap(zero, precision),
                      checkpointing=sections.checkpointing(raw, ignored), offload_optimizer=offload,
                      shard_group=shard_group, hpz=hpz, comm_timeout=comm_timeout, reduce_dtype=reduce_dtype,
                      compile="blocks" if compile is True else compile, ignored=tuple(ignored))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _batch_triple(raw: dict, world: int) -> tuple[int, int, int]:
    """(micro-batch, accumulation steps, global batch): any two imply the third, as in DeepSpeed."""
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    mb, gas, tbs = (sections.number(raw, n, None, n, int) if n in raw else None for n in names)
    for name, value in zip(names, (mb, gas, tbs)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if tbs is not None and mb is not None and gas is None:
        gas = tbs // (mb * world) if tbs % (mb * world) == 0 else None
        if gas is None:
            raise ConfigError(f"train_batch_size {tbs} is not a multiple of micro-batch {mb} x {world} ranks")
    elif tbs is not None and gas is not None and mb is None:
        mb = tbs // (gas * world) if tbs % (gas * world) == 0 else None
        if mb is None:
            raise ConfigError(f"train_batch_size {tbs} is not a multiple of {gas} accumulation steps x {world} ranks")
    elif tbs is not None and mb is None:
        gas = 1
        mb = tbs // world if tbs % world == 0 else None
        if mb is None:
            raise ConfigError(f"train_batch_size {tbs} is not a multiple of {world} ranks")
    elif tbs is None and mb is None:
        raise ConfigError("the config needs train_batch_size or train_micro_batch_size_per_gpu")
    gas = 1 if gas is None else gas
    if tbs is None:
        tbs = mb * gas * world
    if tbs != mb * gas * world:
        raise ConfigError(f"inconsistent batch sizes: train_batch_size {tbs} != micro-batch {mb} x "
                          f"{gas} accumulation steps x {world} ranks")
    if tbs > MAX_GLOBAL_BATCH:
        raise ConfigError(f"train_batch_size {tbs} (micro-batch {mb} x {gas} accumulation steps x {world} ranks) is "
                          f"over the bound of {MAX_GLOBAL_BATCH} sequences per optimizer step")
    return mb, gas, tbs


def as_dict(config: dict, overrides: dict[str, Any]) -> dict:
    """`config` with command-line overrides applied (a key path such as "zero_optimization.stage");
    a value of None removes the key."""
    out = json.loads(json.dumps(config))
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{p} must be a JSON object to set {path}")
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out
