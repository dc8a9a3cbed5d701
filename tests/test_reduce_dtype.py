"""communication_data_type "fp32" (FSDP2's reduce_dtype) under bf16: gradients are accumulated and reduced
in fp32, so a bf16 engine's step is one device's step within fp32 rounding.

One device here is the same model in bf16: its gradient of each micro-batch is, bit for bit, the
engine's local gradient (the same bf16 ops on the same bf16 weights), and the engine's reduced
gradient must be their exact mean within what an fp32 sum of those terms may round
(tests/steps.py, tests/rounding.py). A bf16 sum rounds each add to 8 bits: far outside that, which
is the planted check. The update, from fp32 masters and moments with the fp32 gradient, is held to
exact AdamW as in fp32. The planner plans the fp32 reduction's bytes and memory as it runs.
"""
from __future__ import annotations

import pytest
import torch

from tests.bare import in_world


def bf16_steps(reduce_dtype: str | None, stages=(0, 1, 2, 3)) -> list[float]:
    """Per stage, two steps of a GPT-2 and a Llama of odd widths in bf16 (2 accumulated micro-steps, ignored
    targets), each held to one bf16 device's; the largest fraction of a budget used."""
    import zerofunc
    from tests.steps import check_steps, drawn_steps
    from zerofunc.models import build_model, model_config

    used = []
    for spec in (model_config("gpt2-tiny", n_layer=2, n_embd=40, n_head=4),
                 model_config("llama-tiny", n_layer=2, vocab_size=256)):
        for stage in stages:
            with torch.device("meta"):
                model = build_model(spec)
            config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": stage}, "communication_data_type": reduce_dtype}
            engine = zerofunc.initialize(model, config, init=lambda n, s, m=model: m.init_param(n, s, 0))
            steps = drawn_steps(engine, vocab=256, seq=10, seed=3)
            assert all(g.dtype == torch.float32 for g in steps[0].grads.values()) or reduce_dtype != "fp32"
            used.append(check_steps(build_model(spec).to(torch.bfloat16), steps,
                                    f"{type(spec).__name__} stage {stage}, bf16 reduced in {reduce_dtype}"))
    return used


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_bf16_reduced_in_fp32_trains_like_one_bf16_device(world):
    for used in in_world(world, bf16_steps, "fp32"):
        assert max(used) <= 1.0


def test_reduced_in_bf16_it_does_not():
    """The default (bf16 reduction), held to the same fp32 budget, fails it: what the option is for."""
    with pytest.raises(Exception, match="reduced gradient"):
        in_world(2, bf16_steps, None, (2,))


@pytest.mark.parametrize("world", [1, 3])
def test_the_plan_is_the_step_it_runs(world):
    """Each stage's step in a simulated world (zerofunc.check's cells, on CPU): the planned collectives are
    the executed ones to the byte, every gradient reduction in fp32, and the planned peak is the measured
    one, up to the batch (2 x micro-batch x seq int64 ids), which the tracker counts on the real side
    only from its first view (docs/MEMORY.md)."""
    from zerofunc.check.cells import run_cell
    from zerofunc.plan import Plan, simulate

    mb, seq = 2, 32
    for stage in range(4):
        plan = Plan(world_size=world, stage=stage, model="gpt2-tiny", precision="bf16", micro_batch=mb, seq=seq,
                    hardware="cpu-gloo", reduce_dtype="fp32")
        cell = run_cell(plan, torch.device("cpu"))
        assert cell.ledger_equal and cell.planned_comm == cell.measured_comm, f"stage {stage}"
        assert 0 <= cell.planned_peak - cell.measured_peak <= 2 * mb * seq * 8, f"stage {stage}: {cell}"
        reductions = [e for e in simulate(plan).ledger if e.tag.startswith("grads")]
        assert reductions and all(e.dtype == "float32" for e in reductions), f"stage {stage}: {reductions}"
