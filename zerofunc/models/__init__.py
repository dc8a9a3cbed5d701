"""The model families zerofunc writes out (GPT-2, Llama), and how a name or a config.json picks one.

A model spec is a preset name (`MODELS`), a path to a Hugging Face config.json, or a
config object; `model_config` resolves it and `build_model` builds the model (on the
current default device: the callers build on meta).
"""
from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Union

import torch.nn as nn

from zerofunc.models import gpt2, llama
from zerofunc.models.gpt2 import GPT, GPTConfig
from zerofunc.models.hf_config import hf_config_dict, read_hf_config
from zerofunc.models.llama import Llama, LlamaConfig

ModelConfig = Union[GPTConfig, LlamaConfig]
MODELS: dict[str, ModelConfig] = {**gpt2.MODELS, **llama.MODELS}


def is_config_path(spec: str) -> bool:
    return spec.endswith(".json") or Path(spec).is_file()


@functools.lru_cache(maxsize=32)
def _read(path: str) -> ModelConfig:
    return read_hf_config(path)


def model_config(spec: str | ModelConfig, **overrides) -> ModelConfig:
    """The config a preset name, a config.json path or a config object names; ValueError in one line otherwise."""
    if isinstance(spec, (GPTConfig, LlamaConfig)):
        cfg = spec
    elif is_config_path(spec):
        cfg = _read(str(Path(spec).resolve()))
    elif spec in MODELS:
        cfg = MODELS[spec]
    else:
        raise ValueError(f"unknown model {spec!r}; give a Hugging Face config.json or one of {', '.join(MODELS)}")
    if overrides.get("dropout") and not isinstance(cfg, GPTConfig):
        raise ValueError(f"the {cfg.model_type} family has no dropout; leave it at 0")
    if not isinstance(cfg, GPTConfig):
        overrides.pop("dropout", None)
    return replace(cfg, **overrides)


def build_model(cfg: ModelConfig) -> nn.Module:
    return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)


__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MODELS", "ModelConfig", "build_model", "hf_config_dict",
           "model_config", "read_hf_config"]
