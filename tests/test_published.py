"""The published runs the planner is checked against (benchmarks/published.py) are the models their authors ran."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from zerofunc.models import build_model

ROOT = Path(__file__).resolve().parent.parent


def _published():
    spec = importlib.util.spec_from_file_location("published", ROOT / "benchmarks" / "published.py")
    module = sys.modules["published"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


published = _published()


@pytest.mark.parametrize("cfg", list(published.MPT_PARAMS), ids=lambda c: f"{c.n_layer}x{c.n_embd}")
def test_the_mpt_models_have_llm_foundrys_parameter_counts(cfg):
    """llm-foundry's NumParams column (its models at seq 2048), to the parameter: learned positions and biases
    included. ALiBi without biases (the Hugging Face MPT-7B's config) would miss by 2048 x d_model + 353 x 4096
    parameters at 7B."""
    import torch
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == published.MPT_PARAMS[cfg]


def test_every_row_plans_a_model_and_a_profile_that_exist():
    for run in published.RUNS:
        plan = run.plan()  # validates the profile, the stage, the levers
        assert plan.hardware == run.hardware and run.tokens_per_s > 0
