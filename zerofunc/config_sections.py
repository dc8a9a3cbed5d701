"""The readers of the config's sections and values, each check a one-line `ConfigError`.

`zerofunc.config.parse` calls them in turn. Each reader knows which keys of its section
zerofunc reads, which known DeepSpeed keys it ignores (reported in one warning), and
what values are allowed: wrongly typed, non-finite or out-of-range values are refused
here rather than met by a rank mid-run (tests/test_fuzz_train.py throws arbitrary JSON at them).
"""
from __future__ import annotations

import json
import math
from typing import Optional

from zerofunc.optim import AdamWConfig
from zerofunc.overlap import NO_OVERLAP, Overlap
from zerofunc.recompute import ActivationCheckpointing
from zerofunc.schedule import SCHEDULES, Schedule
from zerofunc.units import PRECISIONS


class ConfigError(ValueError):
    pass


MAX_SCALE_POWER = 64            # fp16.initial_scale_power: a loss scale of 2**64 overflows fp16 at once

IGNORED_TOP = {"steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
               "gradient_predivide_factor", "sparse_gradients", "zero_allow_untested_optimizer",
               "tensorboard", "wandb", "csv_monitor", "comms_logger",
               "flops_profiler", "memory_breakdown", "seq_parallel_communication_data_type",
               "data_types", "checkpoint", "elasticity", "aio", "zero_force_ds_cpu_optimizer"}
IGNORED_ZERO = {"contiguous_gradients", "allgather_bucket_size",
                "reduce_scatter", "allgather_partitions", "round_robin_gradients", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", "sub_group_size",
                "memory_efficient_linear", "elastic_checkpoint",
                "ignore_unused_parameters", "load_from_fp32_weights",
                "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size", "use_multi_rank_bucket_allreduce"}
OFFLOAD_KEYS = {"device"}
IGNORED_OFFLOAD = {"pin_memory", "buffer_count", "fast_init", "nvme_path", "pipeline_read", "pipeline_write",
                   "pipeline", "buffer_size", "max_in_cpu"}
CHECKPOINTING_KEYS = {"mode", "every", "cpu_checkpointing"}
IGNORED_CHECKPOINTING = {"partition_activations", "contiguous_memory_optimization", "number_checkpoints",
                         "synchronize_checkpoint_boundary", "profile"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}
IGNORED_FP16 = {"consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"}

def section_of(raw: dict, key: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a JSON object, got {json.dumps(value)}")
    return value


def check_keys(section: dict, known: set, ignored_known: set, prefix: str, ignored: list) -> None:
    for key in section:
        if key in ignored_known:
            ignored.append(prefix + key)
        elif key not in known:
            raise ConfigError(f"unknown config key {prefix + key!r}")


def number(section: dict, key: str, default, name: str, kind: type):
    value = section.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float))  # JSON's NaN and Infinity are no numbers here
            or isinstance(value, float) and not math.isfinite(value) or (kind is int and value != int(value))):
        raise ConfigError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {json.dumps(value)}")
    return kind(value)


def boolean(section: dict, key: str, default: bool, name: str) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {json.dumps(value)}")
    return value


def fp16(raw: dict, ignored: list) -> dict:
    """The fp16 section with its loss-scaling numbers checked here, whether or not it is enabled, rather
    than when each rank builds its loss scaler."""
    section = section_of(raw, "fp16")
    check_keys(section, FP16_KEYS, IGNORED_FP16, "fp16.", ignored)
    out = {"enabled": boolean(section, "enabled", False, "fp16.enabled")}
    if "loss_scale" in section:
        out["loss_scale"] = number(section, "loss_scale", 0.0, "fp16.loss_scale", float)
        if out["loss_scale"] < 0:
            raise ConfigError(f"fp16.loss_scale must be >= 0 (0: dynamic), got {out['loss_scale']}")
    if "initial_scale_power" in section:
        out["initial_scale_power"] = number(section, "initial_scale_power", 16, "fp16.initial_scale_power", int)
        if not 0 <= out["initial_scale_power"] <= MAX_SCALE_POWER:
            raise ConfigError(f"fp16.initial_scale_power must lie in [0, {MAX_SCALE_POWER}], got "
                              f"{out['initial_scale_power']}")
    for key in ("loss_scale_window", "hysteresis"):
        if key in section:
            out[key] = number(section, key, 1, f"fp16.{key}", int)
            if out[key] < 1:
                raise ConfigError(f"fp16.{key} must be at least 1, got {out[key]}")
    if "min_loss_scale" in section:
        out["min_loss_scale"] = number(section, "min_loss_scale", 1.0, "fp16.min_loss_scale", float)
        if not out["min_loss_scale"] > 0:
            raise ConfigError(f"fp16.min_loss_scale must be positive, got {out['min_loss_scale']}")
    return out


def overlap(zero: dict, precision: str) -> Overlap:
    """DeepSpeed's overlap_comm (off: every collective blocks) and reduce_bucket_size (in
    elements, as DeepSpeed counts it; the gradients' dtype makes it bytes)."""
    on = boolean(zero, "overlap_comm", True, "zero_optimization.overlap_comm")
    elements = number(zero, "reduce_bucket_size", 0, "zero_optimization.reduce_bucket_size", int)
    if elements < 0:
        raise ConfigError(f"zero_optimization.reduce_bucket_size must be >= 0, got {elements}")
    if not on:
        return NO_OVERLAP
    if "reduce_bucket_size" not in zero:
        return Overlap()
    return Overlap(bucket_bytes=elements * PRECISIONS[precision].itemsize)


def offload(zero: dict, stage: int, ignored: list) -> bool:
    """Whether the optimizer is offloaded to the host; parameter and NVMe offload are not implemented."""
    devices = {}
    for key in ("offload_optimizer", "offload_param"):
        section = section_of(zero, key)
        check_keys(section, OFFLOAD_KEYS, IGNORED_OFFLOAD, f"zero_optimization.{key}.", ignored)
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


def checkpointing(raw: dict, ignored: list) -> ActivationCheckpointing:
    if "activation_checkpointing" not in raw:
        return ActivationCheckpointing()
    section = section_of(raw, "activation_checkpointing")
    check_keys(section, CHECKPOINTING_KEYS, IGNORED_CHECKPOINTING, "activation_checkpointing.", ignored)
    if section.get("cpu_checkpointing", False) is not False:
        raise ConfigError("activation_checkpointing.cpu_checkpointing: zerofunc keeps checkpointed activations on "
                          "the device; remove the key or set it to false")
    every = number(section, "every", 2, "activation_checkpointing.every", int)
    try:
        return ActivationCheckpointing(str(section.get("mode", "full")), every)
    except ValueError as e:
        raise ConfigError(f"activation_checkpointing: {e}") from None


def optimizer(raw: dict, ignored: list) -> AdamWConfig:
    opt = section_of(raw, "optimizer")
    check_keys(opt, {"type", "params"}, set(), "optimizer.", ignored)
    kind = opt.get("type", "AdamW")
    if str(kind).lower() not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type {kind!r} is not supported; zerofunc implements Adam and AdamW")
    params = section_of(opt, "params")
    check_keys(params, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"},
                {"torch_adam", "fused", "amsgrad"}, "optimizer.params.", ignored)
    if (not boolean(params, "adam_w_mode", True, "optimizer.params.adam_w_mode")
            or not boolean(params, "bias_correction", True, "optimizer.params.bias_correction")):
        raise ConfigError("zerofunc's Adam has decoupled weight decay and bias correction; "
                          "adam_w_mode and bias_correction cannot be false")
    betas = params.get("betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2):
        raise ConfigError(f"optimizer.params.betas must be a list of two numbers, got {json.dumps(betas)}")
    betas = tuple(number({"beta": b}, "beta", None, "optimizer.params.betas", float) for b in betas)
    if not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"optimizer.params.betas must lie in [0, 1), got {json.dumps(list(betas))}")
    lr = number(params, "lr", 1e-3, "optimizer.params.lr", float)
    eps = number(params, "eps", 1e-8, "optimizer.params.eps", float)
    weight_decay = number(params, "weight_decay", 0.01, "optimizer.params.weight_decay", float)
    if lr < 0:
        raise ConfigError(f"optimizer.params.lr must be >= 0, got {lr}")
    if not eps > 0:  # Adam divides by sqrt(v) + eps, and v starts at 0
        raise ConfigError(f"optimizer.params.eps must be positive, got {eps}")
    if weight_decay < 0:
        raise ConfigError(f"optimizer.params.weight_decay must be >= 0, got {weight_decay}")
    return AdamWConfig(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def schedule(raw: dict) -> Optional[Schedule]:
    if "scheduler" not in raw:
        return None
    sched = section_of(raw, "scheduler")
    kind = sched.get("type")
    if not isinstance(kind, str) or kind not in SCHEDULES:
        raise ConfigError(f"scheduler.type {kind!r} is not supported; choose one of {', '.join(SCHEDULES)}")
    params = section_of(sched, "params")
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
            out[key] = number(params, key, None, name, int)
            if out[key] < (0 if key == "warmup_num_steps" else 1):
                raise ConfigError(f"{name} must be at least {0 if key == 'warmup_num_steps' else 1}, got {out[key]}")
        else:
            out[key] = number(params, key, None, name, float)
            ratio = key.endswith("_ratio")
            if out[key] < 0 or ratio and out[key] > 1:
                raise ConfigError(f"{name} must lie in {'[0, 1]' if ratio else '[0, inf)'}, got {out[key]}")
    if "warmup_num_steps" in out:  # as DeepSpeed reads it: a log warm-up over 1 step would divide by log(1)
        out["warmup_num_steps"] = max(2, out["warmup_num_steps"])
    return Schedule(kind, out)




def hpz(zero: dict, stage: int, group: int, ignored: list[str]) -> Optional[int]:
    """zero_optimization.zero_hpz_partition_size (ZeRO++'s hpZ): stage 3's backward gathers from groups
    of k consecutive ranks, each keeping 1/k of the weights after forward. 1 (DeepSpeed's default), or
    the whole shard group, is off; k must divide the shard group (`group` ranks). Below stage 3 there
    are no gathers: ignored, and listed as such."""
    if "zero_hpz_partition_size" not in zero:
        return None
    k = number(zero, "zero_hpz_partition_size", 1, "zero_optimization.zero_hpz_partition_size", int)
    if k < 1 or group % k:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size must divide the shard group of {group} "
                          f"ranks, got {k}")
    if stage < 3:
        ignored.append("zero_optimization.zero_hpz_partition_size")
        return None
    return None if k in (1, group) else k


def shard_group(zero: dict, world_size: int) -> Optional[int]:
    """zero_optimization.shard_group_size, zerofunc's key, or DeepSpeed's mics_shard_size read as the same:
    the ranks of one shard group under hybrid sharding (None, or -1 as MiCS writes it: the whole world).
    It must divide the world size."""
    keys = [k for k in ("shard_group_size", "mics_shard_size") if k in zero]
    if len(keys) == 2 and zero[keys[0]] != zero[keys[1]]:
        raise ConfigError("zero_optimization.shard_group_size and mics_shard_size disagree; give one")
    if not keys:
        return None
    size = number(zero, keys[0], -1, f"zero_optimization.{keys[0]}", int)
    if size == -1:
        return None
    if size < 1 or world_size % size:
        raise ConfigError(f"zero_optimization.{keys[0]} must divide the world size of {world_size}, got {size}")
    return None if size == world_size else size
