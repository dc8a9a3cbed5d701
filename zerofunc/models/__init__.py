"""The model families zerofunc writes out (GPT-2, Llama), and how a name, a config.json or a model directory picks one.

A model spec is a preset name (`MODELS`), a path to a Hugging Face config.json, a Hugging
Face model directory (its config.json; the weights beside it are the trainer's --init-from
business), or a config object; `model_config` resolves it and `build_model` builds the model
(on the current default device: the callers build on meta). A path wins over a preset of the
same name, as in `from_pretrained`, except a directory without config.json, which a preset
name may share with, say, a folder of runs.
"""
from __future__ import annotations

import functools
import os
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
    """The spec names a config.json: the file itself, or a model directory that holds one (a
    directory that is not a preset's name counts even without it, so that it fails naming it)."""
    path = Path(spec)
    if spec and path.is_dir():  # Path("") is the working directory
        return spec not in MODELS or (path / "config.json").is_file()
    return spec.endswith(".json") or path.is_file()


def config_file(spec: str) -> Path:
    """The config.json a config path names: the file, or a model directory's; ValueError in one line
    for a directory without one."""
    path = Path(spec)
    if not path.is_dir():
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {spec!r} has no config.json (a Hugging Face model directory holds "
                         f"config.json and its safetensors weights)")
    return path / "config.json"


@functools.lru_cache(maxsize=32)
def _read(path: str) -> ModelConfig:
    return read_hf_config(path)


def model_config(spec: str | ModelConfig, **overrides) -> ModelConfig:
    """The config a preset name, a config.json path, a model directory or a config object names;
    ValueError in one line otherwise."""
    if isinstance(spec, (GPTConfig, LlamaConfig)):
        cfg = spec
    elif is_config_path(spec):
        cfg = _read(str(config_file(spec).resolve()))
    elif spec in MODELS:
        cfg = MODELS[spec]
    elif "/" in spec or os.sep in spec:
        raise ValueError(f"{spec!r}: no such model directory or config.json")
    else:
        raise ValueError(f"unknown model {spec!r}; give a Hugging Face model directory or config.json, "
                         f"or one of {', '.join(MODELS)}")
    if overrides.get("dropout") and not isinstance(cfg, GPTConfig):
        raise ValueError(f"the {cfg.model_type} family has no dropout; leave it at 0")
    if not isinstance(cfg, GPTConfig):
        overrides.pop("dropout", None)
    return replace(cfg, **overrides)


def build_model(cfg: ModelConfig) -> nn.Module:
    return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)


__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MODELS", "ModelConfig", "build_model", "config_file",
           "hf_config_dict", "is_config_path", "model_config", "read_hf_config"]
