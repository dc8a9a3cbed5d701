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
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from zerofunc.loss_scale import LossScaler
from zerofunc.optim import AdamWConfig
from zerofunc.overlap import NO_OVERLAP, Overlap
from zerofunc.recompute import ActivationCheckpointing
from zerofunc.schedule import SCHEDULES, Schedule
from zerofunc.units import PRECISIONS


class ConfigError(ValueError):
    pass


# Bounds on what a run may ask for, orders of magnitude past any real run: beyond them a run would
# exhaust memory or hang on launch, so the command line refuses them up front, in one line.
MAX_MICRO_BATCH_TOKENS = 2**24  # tokens per rank per micro-step (micro-batch x seq)
MAX_GLOBAL_BATCH = 2**24        # sequences per optimizer step: each micro-step draws all their offsets anew
MAX_PREFETCH_DEPTH = 1024       # stage 3 blocks gathered ahead of the one computing: more than any model has
MAX_RANKS_PER_CORE = 4          # ranks on a CPU (each a process with its own torch) per core
MAX_COMM_TIMEOUT_S = 7 * 24 * 3600  # a week: no bound at all in practice, and far from timedelta's overflow
MAX_SCALE_POWER = 64            # fp16.initial_scale_power: a loss scale of 2**64 overflows fp16 at once
MAX_BUCKET_MB = 2**20           # --bucket-mb: a TiB of gradient reductions in flight, more than any model has
MAX_SEED = 2**22                # --seed: a sample's id is seed << 40 plus its row of the run, in 64 bits


IGNORED_TOP = {"steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
               "gradient_predivide_factor", "sparse_gradients", "zero_allow_untested_optimizer",
               "communication_data_type", "tensorboard", "wandb", "csv_monitor", "comms_logger",
               "flops_profiler", "memory_breakdown", "seq_parallel_communication_data_type",
               "data_types", "checkpoint", "elasticity", "aio", "zero_force_ds_cpu_optimizer"}
IGNORED_ZERO = {"contiguous_gradients", "allgather_bucket_size",
                "reduce_scatter", "allgather_partitions", "round_robin_gradients", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", "sub_group_size",
                "memory_efficient_linear", "elastic_checkpoint",
                "ignore_unused_parameters", "load_from_fp32_weights", "zero_hpz_partition_size",
                "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size", "use_multi_rank_bucket_allreduce"}
OFFLOAD_KEYS = {"device"}
IGNORED_OFFLOAD = {"pin_memory", "buffer_count", "fast_init", "nvme_path", "pipeline_read", "pipeline_write",
                   "pipeline", "buffer_size", "max_in_cpu"}
CHECKPOINTING_KEYS = {"mode", "every", "cpu_checkpointing"}
IGNORED_CHECKPOINTING = {"partition_activations", "contiguous_memory_optimization", "number_checkpoints",
                         "synchronize_checkpoint_boundary", "profile"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}
IGNORED_FP16 = {"consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"}
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
    comm_timeout: float = 300.0  # seconds a collective waits for the other ranks (zerofunc's key; DeepSpeed has none)
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
             "activation_checkpointing", "comm_timeout"}
    _check_keys(raw, known, IGNORED_TOP, "", ignored)

    zero = _section(raw, "zero_optimization")
    _check_keys(zero, {"stage", "overlap_comm", "reduce_bucket_size", "offload_optimizer", "offload_param",
                       "cpu_offload"}, IGNORED_ZERO, "zero_optimization.", ignored)
    stage = _number(zero, "stage", 0, "zero_optimization.stage", int)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    offload = _offload(zero, stage, ignored)

    fp16, bf16 = _fp16(raw, ignored), _section(raw, "bf16")
    _check_keys(bf16, {"enabled"}, {"immediate_grad_update", "check_grad_overflow"}, "bf16.", ignored)
    bf16_on = _bool(bf16, "enabled", False, "bf16.enabled")
    if fp16["enabled"] and bf16_on:
        raise ConfigError("fp16 and bf16 are both enabled; enable at most one")
    precision = "fp16" if fp16["enabled"] else "bf16" if bf16_on else "fp32"

    clip = _number(raw, "gradient_clipping", 0.0, "gradient_clipping", float)
    if clip < 0:
        raise ConfigError(f"gradient_clipping must be >= 0, got {clip}")
    comm_timeout = _number(raw, "comm_timeout", 300.0, "comm_timeout", float)
    if not 0 < comm_timeout <= MAX_COMM_TIMEOUT_S:
        raise ConfigError(f"comm_timeout must be a number of seconds in (0, {MAX_COMM_TIMEOUT_S}], got {comm_timeout}")
    mb, gas, tbs = _batch_triple(raw, world_size)
    try:
        return Config(stage=stage, micro_batch=mb, grad_accum=gas, train_batch_size=tbs, precision=precision,
                      clip=clip, optimizer=_optimizer(raw, ignored), fp16=fp16, schedule=_schedule(raw),
                      overlap=_overlap(zero, precision), checkpointing=_checkpointing(raw, ignored),
                      offload_optimizer=offload, comm_timeout=comm_timeout, ignored=tuple(ignored))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _fp16(raw: dict, ignored: list) -> dict:
    """The fp16 section with its loss-scaling numbers checked here, whether or not it is enabled, rather
    than when each rank builds its loss scaler."""
    section = _section(raw, "fp16")
    _check_keys(section, FP16_KEYS, IGNORED_FP16, "fp16.", ignored)
    out = {"enabled": _bool(section, "enabled", False, "fp16.enabled")}
    if "loss_scale" in section:
        out["loss_scale"] = _number(section, "loss_scale", 0.0, "fp16.loss_scale", float)
        if out["loss_scale"] < 0:
            raise ConfigError(f"fp16.loss_scale must be >= 0 (0: dynamic), got {out['loss_scale']}")
    if "initial_scale_power" in section:
        out["initial_scale_power"] = _number(section, "initial_scale_power", 16, "fp16.initial_scale_power", int)
        if not 0 <= out["initial_scale_power"] <= MAX_SCALE_POWER:
            raise ConfigError(f"fp16.initial_scale_power must lie in [0, {MAX_SCALE_POWER}], got "
                              f"{out['initial_scale_power']}")
    for key in ("loss_scale_window", "hysteresis"):
        if key in section:
            out[key] = _number(section, key, 1, f"fp16.{key}", int)
            if out[key] < 1:
                raise ConfigError(f"fp16.{key} must be at least 1, got {out[key]}")
    if "min_loss_scale" in section:
        out["min_loss_scale"] = _number(section, "min_loss_scale", 1.0, "fp16.min_loss_scale", float)
        if not out["min_loss_scale"] > 0:
            raise ConfigError(f"fp16.min_loss_scale must be positive, got {out['min_loss_scale']}")
    return out


def _bool(section: dict, key: str, default: bool, name: str) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {json.dumps(value)}")
    return value


def _overlap(zero: dict, precision: str) -> Overlap:
    """DeepSpeed's overlap_comm (off: every collective blocks) and reduce_bucket_size (in
    elements, as DeepSpeed counts it; the gradients' dtype makes it bytes)."""
    on = _bool(zero, "overlap_comm", True, "zero_optimization.overlap_comm")
    elements = _number(zero, "reduce_bucket_size", 0, "zero_optimization.reduce_bucket_size", int)
    if elements < 0:
        raise ConfigError(f"zero_optimization.reduce_bucket_size must be >= 0, got {elements}")
    if not on:
        return NO_OVERLAP
    if "reduce_bucket_size" not in zero:
        return Overlap()
    return Overlap(bucket_bytes=elements * PRECISIONS[precision].itemsize)


def _offload(zero: dict, stage: int, ignored: list) -> bool:
    """Whether the optimizer is offloaded to the host; parameter and NVMe offload are not implemented."""
    devices = {}
    for key in ("offload_optimizer", "offload_param"):
        section = _section(zero, key)
        _check_keys(section, OFFLOAD_KEYS, IGNORED_OFFLOAD, f"zero_optimization.{key}.", ignored)
        devices[key] = section.get("device", "none")
    legacy = zero.get("cpu_offload", False)
    if not isinstance(legacy, bool):
        raise ConfigError(f"zero_optimization.cpu_offload must be true or false, got {json.dumps(legacy)}")
    if devices["offload_param"] != "none":
        raise ConfigError(f"zero_optimization.offload_param.device {json.dumps(devices['offload_param'])}: zerofunc "
                          "does not offload parameters; remove the section or set its device to \"none\"")
    device = "cpu" if legacy else devices["offload_optimizer"]
    if device not in ("cpu", "none"):
        raise ConfigError(f"zero_optimization.offload_optimizer.device must be \"cpu\" or \"none\", got "
                          f"{json.dumps(device)} (zerofunc does not offload to NVMe)")
    if device == "cpu" and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3")
    return device == "cpu"


def _checkpointing(raw: dict, ignored: list) -> ActivationCheckpointing:
    if "activation_checkpointing" not in raw:
        return ActivationCheckpointing()
    section = _section(raw, "activation_checkpointing")
    _check_keys(section, CHECKPOINTING_KEYS, IGNORED_CHECKPOINTING, "activation_checkpointing.", ignored)
    if section.get("cpu_checkpointing", False) is not False:
        raise ConfigError("activation_checkpointing.cpu_checkpointing: zerofunc keeps checkpointed activations on "
                          "the device; remove the key or set it to false")
    every = _number(section, "every", 2, "activation_checkpointing.every", int)
    try:
        return ActivationCheckpointing(str(section.get("mode", "full")), every)
    except ValueError as e:
        raise ConfigError(f"activation_checkpointing: {e}") from None


def _section(raw: dict, key: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a JSON object, got {json.dumps(value)}")
    return value


def _check_keys(section: dict, known: set, ignored_known: set, prefix: str, ignored: list) -> None:
    for key in section:
        if key in ignored_known:
            ignored.append(prefix + key)
        elif key not in known:
            raise ConfigError(f"unknown config key {prefix + key!r}")


def _number(section: dict, key: str, default, name: str, kind: type):
    value = section.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float))  # JSON's NaN and Infinity are no numbers here
            or isinstance(value, float) and not math.isfinite(value) or (kind is int and value != int(value))):
        raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {json.dumps(value)}")
    return kind(value)


def _batch_triple(raw: dict, world: int) -> tuple[int, int, int]:
    """(micro-batch, accumulation steps, global batch): any two imply the third, as in DeepSpeed."""
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    mb, gas, tbs = (_number(raw, n, None, n, int) if n in raw else None for n in names)
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


def _optimizer(raw: dict, ignored: list) -> AdamWConfig:
    opt = _section(raw, "optimizer")
    _check_keys(opt, {"type", "params"}, set(), "optimizer.", ignored)
    kind = opt.get("type", "AdamW")
    if str(kind).lower() not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type {kind!r} is not supported; zerofunc implements Adam and AdamW")
    params = _section(opt, "params")
    _check_keys(params, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"},
                {"torch_adam", "fused", "amsgrad"}, "optimizer.params.", ignored)
    if (not _bool(params, "adam_w_mode", True, "optimizer.params.adam_w_mode")
            or not _bool(params, "bias_correction", True, "optimizer.params.bias_correction")):
        raise ConfigError("zerofunc's Adam has decoupled weight decay and bias correction; "
                          "adam_w_mode and bias_correction cannot be false")
    betas = params.get("betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2):
        raise ConfigError(f"optimizer.params.betas must be a list of two numbers, got {json.dumps(betas)}")
    betas = tuple(_number({"beta": b}, "beta", None, "optimizer.params.betas", float) for b in betas)
    if not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"optimizer.params.betas must lie in [0, 1), got {json.dumps(list(betas))}")
    lr = _number(params, "lr", 1e-3, "optimizer.params.lr", float)
    eps = _number(params, "eps", 1e-8, "optimizer.params.eps", float)
    weight_decay = _number(params, "weight_decay", 0.01, "optimizer.params.weight_decay", float)
    if lr < 0:
        raise ConfigError(f"optimizer.params.lr must be >= 0, got {lr}")
    if not eps > 0:  # Adam divides by sqrt(v) + eps, and v starts at 0
        raise ConfigError(f"optimizer.params.eps must be positive, got {eps}")
    if weight_decay < 0:
        raise ConfigError(f"optimizer.params.weight_decay must be >= 0, got {weight_decay}")
    return AdamWConfig(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _schedule(raw: dict) -> Optional[Schedule]:
    if "scheduler" not in raw:
        return None
    sched = _section(raw, "scheduler")
    kind = sched.get("type")
    if not isinstance(kind, str) or kind not in SCHEDULES:
        raise ConfigError(f"scheduler.type {kind!r} is not supported; choose one of {', '.join(SCHEDULES)}")
    params = _section(sched, "params")
    for key in params:
        if key not in SCHEDULES[kind]:
            raise ConfigError(f"unknown config key 'scheduler.params.{key}' for {kind}")
    if kind != "WarmupLR" and "total_num_steps" not in params:
        raise ConfigError(f"scheduler {kind} needs params.total_num_steps")
    out = {}
    for key, value in params.items():  # checked here: a rank computes the rate from them at every step
        name = f"scheduler.params.{key}"
        if key == "warmup_type":
            if value not in ("log", "linear"):
                raise ConfigError(f"{name} must be \"log\" or \"linear\", got {json.dumps(value)}")
            out[key] = value
        elif key in ("warmup_num_steps", "total_num_steps"):
            out[key] = _number(params, key, None, name, int)
            if out[key] < (0 if key == "warmup_num_steps" else 1):
                raise ConfigError(f"{name} must be at least {0 if key == 'warmup_num_steps' else 1}, got {out[key]}")
        else:
            out[key] = _number(params, key, None, name, float)
            ratio = key.endswith("_ratio")
            if out[key] < 0 or ratio and out[key] > 1:
                raise ConfigError(f"{name} must lie in {'[0, 1]' if ratio else '[0, inf)'}, got {out[key]}")
    if "warmup_num_steps" in out:  # as DeepSpeed reads it: a log warm-up over 1 step would divide by log(1)
        out["warmup_num_steps"] = max(2, out["warmup_num_steps"])
    return Schedule(kind, out)


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
