"""The DeepSpeed-style config: batch triple, keys, precision, optimizer, schedules."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from zerofunc.config import ConfigError, Schedule, as_dict, parse
from zerofunc.overlap import NO_OVERLAP, Overlap

EXAMPLE = Path(__file__).parent.parent / "examples" / "ds_config_zero2.json"


@settings(max_examples=100)  # its own count: the suite's profiles (tests/conftest.py) size in-world tests
@given(mb=st.integers(1, 16), gas=st.integers(1, 8), world=st.integers(1, 8),
       given_keys=st.sampled_from([(0, 1), (0, 2), (1, 2), (0, 1, 2)]))
def test_any_two_of_the_batch_triple_imply_the_third(mb, gas, world, given_keys):
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    values = (mb, gas, mb * gas * world)
    cfg = parse({names[i]: values[i] for i in given_keys}, world)
    assert (cfg.micro_batch, cfg.grad_accum, cfg.train_batch_size) == values


def test_inconsistent_or_missing_batch_sizes_are_errors():
    with pytest.raises(ConfigError, match="inconsistent batch sizes"):
        parse({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2)
    with pytest.raises(ConfigError, match="not a multiple"):
        parse({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2)
    with pytest.raises(ConfigError, match="needs train_batch_size or train_micro_batch_size_per_gpu"):
        parse({"gradient_accumulation_steps": 2}, 2)
    with pytest.raises(ConfigError, match="must be at least 1"):
        parse({"train_micro_batch_size_per_gpu": 0}, 2)


def test_deepspeed_documentation_config_reads():
    cfg = parse(str(EXAMPLE), 2)
    assert (cfg.stage, cfg.precision, cfg.micro_batch, cfg.grad_accum, cfg.train_batch_size) == (2, "bf16", 4, 4, 32)
    assert cfg.clip == 1.0 and cfg.optimizer.lr == 1e-3
    assert set(cfg.ignored) == {f"zero_optimization.{k}" for k in (
        "allgather_partitions", "allgather_bucket_size", "reduce_scatter", "contiguous_gradients")}
    assert cfg.overlap == NO_OVERLAP  # "overlap_comm": false


def test_overlap_settings():
    def overlap(zero, precision="fp32"):
        half = {} if precision == "fp32" else {precision: {"enabled": True}}
        return parse({"train_batch_size": 2, "zero_optimization": zero, **half}, 1).overlap
    assert overlap({}) == Overlap()
    assert overlap({"reduce_bucket_size": 1000}) == Overlap(bucket_bytes=4000)  # elements, as DeepSpeed counts
    assert overlap({"reduce_bucket_size": 1000}, "bf16") == Overlap(bucket_bytes=2000)
    assert overlap({"overlap_comm": True, "reduce_bucket_size": 0}) == Overlap(bucket_bytes=0)


@pytest.mark.parametrize("raw, message", [
    ({"train_batch_size": 2, "trian_micro_batch": 1}, "unknown config key 'trian_micro_batch'"),
    ({"train_batch_size": 2, "zero_optimization": {"stage": 2, "stagee": 3}}, "'zero_optimization.stagee'"),
    ({"train_batch_size": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"train_batch_size": 2, "zero_optimization": {"stage": 4}}, "must be 0, 1, 2 or 3"),
    ({"train_batch_size": 2, "zero_optimization": 3}, "zero_optimization must be a JSON object"),
    ({"train_batch_size": 2, "optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
    ({"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "cannot be false"),
    ({"train_batch_size": 2, "gradient_clipping": "1.0"}, "gradient_clipping must be a number"),
    ({"train_batch_size": 2, "zero_optimization": {"overlap_comm": 1}}, "overlap_comm must be true or false"),
    ({"train_batch_size": 2, "zero_optimization": {"reduce_bucket_size": -5}}, "reduce_bucket_size must be >= 0"),
    ({"train_batch_size": 2, "scheduler": {"type": "OneCycle"}}, "'OneCycle' is not supported"),
    ({"train_batch_size": 2, "scheduler": {"type": "WarmupCosineLR", "params": {}}}, "needs params.total_num_steps"),
])
def test_bad_configs_name_the_problem(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse(raw, 1)


def test_files_that_cannot_be_read(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse(str(tmp_path / "missing.json"), 1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 2,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse(str(bad), 1)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        parse(str(bad), 1)


def test_overrides_replace_file_values():
    raw = json.loads(EXAMPLE.read_text())
    cfg = parse(as_dict(raw, {"zero_optimization.stage": 3, "gradient_accumulation_steps": 2}), 2)
    assert (cfg.stage, cfg.grad_accum, cfg.train_batch_size) == (3, 2, 16)
    assert raw["zero_optimization"]["stage"] == 2  # the original is untouched


def test_fp16_loss_scaler_settings():
    cfg = parse({"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3,
                                                 "loss_scale_window": 50, "min_loss_scale": 4}}, 1)
    s = cfg.loss_scaler()
    assert (s.scale, s.dynamic, s.hysteresis, s.window, s.min_scale) == (4096, True, 3, 50, 4)
    static = parse({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 128}}, 1).loss_scaler()
    assert (static.scale, static.dynamic) == (128, False)
    assert parse({"train_batch_size": 1}, 1).loss_scaler() is None


def test_schedules():
    warm = Schedule("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 10,
                                 "warmup_type": "linear"})
    assert [warm.lr(s, 9.9) for s in (1, 6, 11, 500)] == [0.0, 0.5, 1.0, 1.0]
    log = Schedule("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 100})
    assert log.lr(1, 1.0) == 0.0 and log.lr(10, 1.0) == pytest.approx(math.log(10) / math.log(100))
    cos = Schedule("WarmupCosineLR", {"total_num_steps": 110, "warmup_num_steps": 10, "warmup_type": "linear",
                                      "cos_min_ratio": 0.0, "warmup_min_ratio": 0.0})
    assert cos.lr(1, 2.0) == 0.0 and cos.lr(11, 2.0) == pytest.approx(2.0)
    assert cos.lr(61, 2.0) == pytest.approx(1.0) and cos.lr(111, 2.0) == pytest.approx(0.0, abs=1e-12)
    decay = Schedule("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 10, "warmup_max_lr": 1.0,
                                       "warmup_type": "linear"})
    assert decay.lr(11, 5.0) == 1.0 and decay.lr(16, 5.0) == pytest.approx(0.5) and decay.lr(21, 5.0) == 0.0
