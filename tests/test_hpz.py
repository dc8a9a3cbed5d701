"""hpZ (zero_optimization.zero_hpz_partition_size k, ZeRO++'s name): stage 3 keeps 1/k of each unit's
weights after forward, and backward gathers them from k consecutive ranks instead of the whole shard
group. The weights gathered are the same bytes, so it trains like one device under the derived
budgets (tests/steps.py); backward's gathers run on the secondary group; the planner plans it."""
from __future__ import annotations

import pytest
import torch

from tests.bare import in_world

OPT = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.1}}


def hpz_steps(k: int, shard_group=None, wrong_slice: bool = False) -> list[tuple[float, set]]:
    """Two accumulated steps of a GPT-2 and a Llama of odd widths at stage 3 with hpZ k, each held to one
    device's step: (the largest fraction of a budget used, the groups backward's gathers ran on).
    `wrong_slice` plants the bug of keeping the neighbour's part after forward."""
    import zerofunc
    import zerofunc.gather as gather
    from tests.steps import check_steps, drawn_steps
    from zerofunc.models import build_model, model_config

    if wrong_slice:
        keep = gather.shard
        gather.shard = lambda flat, rank, n: keep(flat, (rank + 1) % n, n)
    out = []
    for spec in (model_config("gpt2-tiny", n_layer=2, n_embd=40, n_head=4),
                 model_config("llama-tiny", n_layer=2, vocab_size=256)):
        with torch.device("meta"):
            model = build_model(spec)
        zero = {"stage": 3, "zero_hpz_partition_size": k} | ({"shard_group_size": shard_group} if shard_group else {})
        engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                             "zero_optimization": zero, "optimizer": OPT},
                                     init=lambda n, s, m=model: m.init_param(n, s, 0))
        steps = drawn_steps(engine, vocab=256, seq=10, seed=11)
        used = check_steps(build_model(spec), steps, f"{type(spec).__name__} hpZ {k}")
        out.append((used, {e.group for e in engine.comm.ledger if e.tag == "params.bwd"}))
    return out


def test_hpz_trains_like_one_device_and_gathers_backward_in_its_group():
    for per_rank in in_world(4, hpz_steps, 2):
        for used, groups in per_rank:
            assert used <= 1.0
            assert groups == {"secondary"}, "every backward gather from the hpZ group"


@pytest.mark.slow
def test_keeping_the_wrong_part_does_not():
    """The planted bug, kept as a test: each rank keeps its neighbour's 1/k, so backward's weights are
    permuted and the gradients fail their check."""
    with pytest.raises(Exception, match="reduced gradient|parameters"):
        in_world(4, hpz_steps, 2, None, True)


def test_hpz_config():
    from zerofunc.config import ConfigError, parse as parse_config

    def parse(zero, world=8):
        return parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world)

    assert parse({"stage": 3, "zero_hpz_partition_size": 4}).hpz == 4
    assert parse({"stage": 3, "zero_hpz_partition_size": 2, "shard_group_size": 4}).hpz == 2
    for off in (1, 8):  # DeepSpeed's default, and the whole shard group: nothing to do
        assert parse({"stage": 3, "zero_hpz_partition_size": off}).hpz is None
    below = parse({"stage": 2, "zero_hpz_partition_size": 4})
    assert below.hpz is None and "zero_optimization.zero_hpz_partition_size" in below.ignored
    with pytest.raises(ConfigError, match="must divide the shard group of 4 ranks, got 8"):
        parse({"stage": 3, "zero_hpz_partition_size": 8, "shard_group_size": 4})
    with pytest.raises(ConfigError, match="must divide the shard group of 8 ranks, got 3"):
        parse({"stage": 3, "zero_hpz_partition_size": 3})


def planned_and_executed(k: int, grad_accum: int) -> tuple[bool, float, float]:
    """One step at stage 3 with hpZ k, traced; the planner's simulation of it: (same ledger, peak planned
    over measured, the most weight bytes held at once over the same step's without hpZ)."""
    import zerofunc
    from sim.memory import MemoryTracker
    from zerofunc.models import build_model, model_config
    from zerofunc.plan import Plan, simulate
    from zerofunc.step import train_step

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    cfg = model_config("gpt2-tiny", n_layer=3, n_embd=48, n_head=4)
    peaks = []
    for hpz in (k, None):
        with torch.device("meta"):
            model = build_model(cfg)
        tracker = MemoryTracker()
        zero = {"stage": 3} | ({"zero_hpz_partition_size": hpz} if hpz else {})
        engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps":
                                             grad_accum, "zero_optimization": zero},
                                     init=lambda n, s, m=model: m.init_param(n, s, 0), memory=tracker)
        rows = torch.randint(0, 256, (2 * world * grad_accum, 17), generator=torch.Generator().manual_seed(2))
        batches = [(rows[i:i + 2, :-1], rows[i:i + 2, 1:]) for i in range(0, len(rows), 2)]
        with tracker:
            train_step(engine, batches[rank::world])
        peaks.append(tracker.report().max_by_category["params"])
        if hpz:
            sim = simulate(Plan(world_size=world, stage=3, model=cfg, precision="fp32", micro_batch=2, seq=16,
                                grad_accum=grad_accum, hpz=hpz, hardware="cpu-gloo"))
            same = sim.ledger == engine.comm.ledger.entries and any(e.group == "secondary" for e in sim.ledger)
            ratio = sim.memory.peak / tracker.peak
    return same, ratio, peaks[0] / peaks[1]


@pytest.mark.slow
def test_the_planner_plans_what_hpz_does():
    """On 4 gloo ranks with k = 2 and accumulation: the same collectives on the same groups, to the byte,
    and the peak within 2%; the kept copies show as weights held from forward to backward."""
    for same, ratio, params_over_plain in in_world(4, planned_and_executed, 2, 2):
        assert same
        assert abs(ratio - 1) <= 0.02, f"peak planned / measured {ratio:.4f}"
        assert params_over_plain > 1.0


@pytest.mark.slow
def test_the_trainer_takes_hpz(tmp_path, capsys, tiny_data):
    """python -m train --hpz 2 on 4 ranks at stage 3 gathers the same bytes, so its losses are the plain
    run's bit for bit; a K that does not divide the ranks is one line, exit 2."""
    import json

    from train.cli import main

    def losses(*extra):
        out = tmp_path / "-".join(["run", *extra])
        assert main(["--nproc", "4", "--stage", "3", "--steps", "3", "--seq", "16", "--micro-batch", "2",
                     "--data", tiny_data, "--out", str(out), *extra]) == 0
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert losses("--hpz", "2") == losses()
    capsys.readouterr()
    assert main(["--nproc", "4", "--stage", "3", "--hpz", "3", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must divide the shard group of 4 ranks, got 3" in err


def test_the_planner_takes_hpz(capsys):
    import json

    from zerofunc.plan.__main__ import main

    base = ["--model", "llama-tiny", "--seq", "64", "--levers", "none", "--stage", "3", "--json"]
    assert main([*base, "--world-size", "8", "--hpz", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"]["hpz"] == 4
    cmd = doc["recommended_command"]
    assert cmd[cmd.index("--hpz") + 1] == "4"
    assert main([*base, "--world-size", "8", "--hpz", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an hpZ group of 3 ranks does not divide the shard group of 8" in err
