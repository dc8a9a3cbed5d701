"""Hybrid sharding (zero_optimization.shard_group_size S, or DeepSpeed's mics_shard_size): stages 1-3 shard
within groups of S consecutive ranks, and each gradient shard is averaged over the replicas once per
optimizer step. It trains like one device, step by step (tests/steps.py: ignored targets drawn, 2
accumulated micro-steps, the derived rounding budgets), at S in {1, 2, 4} on 4 ranks and {1, 3} on 3,
with clipping that binds and optimizer offload drawn in turn, and it issues exactly one replicas'
all-reduce per unit per optimizer step.
Checkpoints, written by the first shard group, load at any S, stage and world size; the trainer's flag
shards within groups, and the planner's ledger and peak are the executed ones."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.bare import in_world

CASES = {4: (1, 2, 4), 3: (1, 3), 2: (1,)}


def hybrid_steps(sizes: tuple[int, ...], skip_replicas: bool = False) -> list[float]:
    """Per S and stage 1-3, two steps of a GPT-2 and a Llama of odd widths, each held to one device's step;
    the largest fraction of a budget used. Cases take, in turn, clipping at 0.05 (below every norm here:
    it binds, so the norm's reduction over the groups matters) or none, and optimizer offload or none, so
    every pair comes up at 2 ranks. `skip_replicas` plants the bug of never averaging over them."""
    import zerofunc
    from tests.steps import check_steps, drawn_steps
    from zerofunc.models import build_model, model_config

    used, case = [], 0
    for spec in (model_config("gpt2-tiny", n_layer=2, n_embd=40, n_head=4),
                 model_config("llama-tiny", n_layer=2, vocab_size=256)):
        for size in sizes:
            for stage in (1, 2, 3):
                clip, offload = (0.05, 0.0)[case % 2], case // 2 % 2 == 0
                case += 1
                with torch.device("meta"):
                    model = build_model(spec)
                engine = zerofunc.initialize(model, {
                    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": clip,
                    "zero_optimization": {"stage": stage, "shard_group_size": size,
                                          "offload_optimizer": {"device": "cpu" if offload else "none"}},
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5,
                                                              "weight_decay": 0.1}}},
                    init=lambda n, s, m=model: m.init_param(n, s, 0))
                assert engine.comm.world_size == size
                what = f"{type(spec).__name__} S={size} stage {stage}, clip {clip}, offload {offload}"
                averaged = []
                if engine.replicas is not None:
                    reduce = engine.replicas.all_reduce

                    def counted(t, tag="", mean=True, async_op=False, reduce=reduce):
                        if tag != "grads.replicas":
                            return reduce(t, tag, mean, async_op)
                        averaged.append(tag)
                        # the planted bug: the gradient shards' all-reduce over the replicas never issued
                        return SimpleNamespace(wait=lambda: None) if skip_replicas else reduce(t, tag, mean, async_op)
                    engine.replicas.all_reduce = counted
                steps = drawn_steps(engine, vocab=256, seq=10, seed=11)
                used.append(check_steps(build_model(spec), steps, what))
                norms = [torch.sqrt(sum(g.double().square().sum() for g in st.grads.values())).item() for st in steps]
                assert not clip or min(norms) > clip, f"{what}: clipping at {clip} does not bind at norms {norms}"
                # each unit's gradient shard, averaged over the replicas once per optimizer step (none without them)
                want = len(steps) * len(engine.units) if engine.replicas is not None else 0
                assert len(averaged) == want, f"{what}: {len(averaged)} replicas' all-reduces in {len(steps)} steps"
    return used


@pytest.mark.parametrize("world", [2, *(pytest.param(n, marks=pytest.mark.slow) for n in (3, 4))])
def test_hybrid_sharding_trains_like_one_device(world):
    for used in in_world(world, hybrid_steps, CASES[world]):
        assert max(used) <= 1.0


@pytest.mark.slow
def test_without_the_replicas_average_it_does_not():
    """The planted bug, kept as a test: shards reduced within their group only fail the gradient check."""
    with pytest.raises(Exception, match="reduced gradient"):
        in_world(4, hybrid_steps, (2,), True)


def test_a_shard_group_must_divide_the_world():
    from zerofunc.config import ConfigError, parse as parse_config

    def parse(config, world):
        return parse_config({"train_micro_batch_size_per_gpu": 1} | config, world)

    with pytest.raises(ConfigError, match="must divide the world size of 4, got 3"):
        parse({"zero_optimization": {"stage": 3, "shard_group_size": 3}}, 4)
    assert parse({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, 4).shard_group == 2
    assert parse({"zero_optimization": {"stage": 3, "mics_shard_size": -1}}, 4).shard_group is None
    assert parse({"zero_optimization": {"stage": 3, "shard_group_size": 4}}, 4).shard_group is None


def engine_of(stage: int, size, seed: int = 0):
    import zerofunc
    from zerofunc.models import build_model, model_config

    with torch.device("meta"):
        model = build_model(model_config("gpt2-tiny", n_layer=2, n_embd=40, n_head=4))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    if size is not None:
        config["zero_optimization"]["shard_group_size"] = size
    return zerofunc.initialize(model, config, init=lambda n, s: model.init_param(n, s, seed))


def save_and_reload(run_dir: str) -> bool:
    """On 4 ranks: a step at stage 3 with S=2, saved; loaded into stage 1 with S=4, stage 2 with S=1 and
    stage 3 with no groups (seeded differently, so a load that reads nothing shows): weights and AdamW's
    moments equal the saved ones bit for bit, and the optimizer's step count carries over."""
    from zerofunc import checkpoint
    from zerofunc.step import train_step

    saved = engine_of(3, 2)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    rows = torch.randint(0, 256, (2 * world, 9), generator=torch.Generator().manual_seed(1))
    train_step(saved, [(rows[2 * rank:2 * rank + 2, :-1], rows[2 * rank:2 * rank + 2, 1:])])
    checkpoint.save(saved, run_dir, 1)
    want, (m, v) = saved.full_parameters(), saved.full_moments()
    same = True
    for stage, size in ((1, 4), (2, 1), (3, None)):
        engine = engine_of(stage, size, seed=5)
        manifest = checkpoint.load(engine, run_dir)
        got, (gm, gv) = engine.full_parameters(), engine.full_moments()
        same &= manifest["world_size"] == 2 and engine.state.steps == 1
        same &= all(torch.equal(got[n], want[n]) and torch.equal(gm[n], m[n]) and torch.equal(gv[n], v[n])
                    for n in want)
    return same


@pytest.mark.slow
def test_checkpoints_move_across_shard_groups_stages_and_worlds(tmp_path):
    """Saved by the first shard group's ranks (every replica holds the same shards), as a checkpoint of
    S ranks: it loads at any S, stage and world size, as any checkpoint does."""
    assert all(in_world(4, save_and_reload, str(tmp_path / "run")))
    from zerofunc.checkpoint_files import read_manifest, resolve

    manifest = read_manifest(resolve(tmp_path / "run"))
    assert manifest["files"] == ["rank-00000.safetensors", "rank-00001.safetensors"]


@pytest.mark.slow
def test_the_trainer_shards_within_groups(tmp_path, capsys, tiny_data):
    """python -m train --shard-group 2 on 4 ranks trains, and its checkpoint is one of 2 shard ranks;
    a group that does not divide the ranks is one line, exit 2."""
    from train.cli import main
    from zerofunc.checkpoint_files import read_manifest, resolve

    run = tmp_path / "run"
    assert main(["--nproc", "4", "--shard-group", "2", "--steps", "2", "--seq", "16", "--micro-batch", "2",
                 "--save-every", "2", "--data", tiny_data, "--out", str(run)]) == 0
    manifest = read_manifest(resolve(run))
    assert manifest["world_size"] == 2 and len(manifest["files"]) == 2 and manifest["stage"] == 3
    capsys.readouterr()
    assert main(["--nproc", "4", "--shard-group", "3", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must divide the world size of 4, got 3" in err


def planned_and_executed(size: int, grad_accum: int) -> list[tuple[int, bool, float]]:
    """Per stage 1-3: the planner's simulated step of a 4-rank world with shard groups of `size` against
    this rank's executed step: (stage, the ledgers equal entry by entry, group names included, peak
    planned / measured)."""
    import zerofunc
    from sim.memory import MemoryTracker
    from zerofunc.models import build_model, model_config
    from zerofunc.plan import Plan, simulate
    from zerofunc.step import train_step

    cfg = model_config("gpt2-tiny", n_layer=2, n_embd=40, n_head=4)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    out = []
    for stage in (1, 2, 3):
        tracker = MemoryTracker()
        with torch.device("meta"):
            model = build_model(cfg)
        engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps":
                                             grad_accum, "zero_optimization": {"stage": stage,
                                                                               "shard_group_size": size}},
                                     init=lambda n, s, m=model: m.init_param(n, s, 0), memory=tracker)
        rows = torch.randint(0, 256, (2 * world * grad_accum, 17), generator=torch.Generator().manual_seed(2))
        batches = [(rows[i:i + 2, :-1], rows[i:i + 2, 1:]) for i in range(0, len(rows), 2)]
        with tracker:
            train_step(engine, batches[rank::world])
        sim = simulate(Plan(world_size=world, stage=stage, model=cfg, precision="fp32", micro_batch=2, seq=16,
                            grad_accum=grad_accum, shard_group=size, hardware="cpu-gloo"))
        out.append((stage, sim.ledger == engine.comm.ledger.entries, sim.memory.peak / tracker.peak))
    return out


@pytest.mark.slow
def test_the_planner_plans_what_hybrid_sharding_does():
    """On 4 gloo ranks with shard groups of 2, with accumulation: the same collectives on the same groups,
    to the byte, and the peak within 2% (the tracker counts the same tensors on meta and real ones)."""
    for per_rank in in_world(4, planned_and_executed, 2, 2):
        for stage, same_ledger, ratio in per_rank:
            assert same_ledger, f"stage {stage}"
            assert abs(ratio - 1) <= 0.02, f"stage {stage}: peak planned / measured {ratio:.4f}"
