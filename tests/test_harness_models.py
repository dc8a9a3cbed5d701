"""The CPU harness's models shipped as config.json (benchmarks/models/), so that a GPU runs the rows issue 31
measures on the CPU (docs/CUDA.md: the `whole` part's WHOLE_MODEL): each file must build the model
benchmarks/peers.py builds for the same name, or the GPU's rows measure another model than the CPU's."""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from zerofunc.models import MODELS, model_config

ROOT = Path(__file__).resolve().parent.parent


def _harness_models() -> dict:
    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODELS


@pytest.mark.parametrize("name", ["30m", "120m"])
def test_the_shipped_config_is_the_harness_s_model(name):
    """The config the trainer reads from the file equals the harness's (its base preset with its overrides),
    field by field (tests/plants.py: harness_config_of_another_width)."""
    base, overrides = _harness_models()[name][:2]
    assert model_config(str(ROOT / "benchmarks" / "models" / f"gpt2-{name}.json")) == replace(MODELS[base], **overrides)
