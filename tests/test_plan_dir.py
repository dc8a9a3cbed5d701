"""A Hugging Face model directory is a model spec, and the planner plans what the trainer loads:
its recommendation comes with the python -m train command that runs it, and that command parses,
with train/cli.py's own parser, into the very config the plan simulated."""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from train.cli import parse as train_parse
from zerofunc.models import hf_config_dict, model_config
from zerofunc.plan import Plan
from zerofunc.plan.__main__ import main as plan_main
from zerofunc.plan.command import DATA, command, nodes
from zerofunc.recompute import MODES
from zerofunc.units import PRECISIONS
from zerofunc.usage import UsageError

PRESETS = ("gpt2-tiny", "llama-tiny")


def model_dir(root: Path, preset: str, weights: bool = False) -> Path:
    """A Hugging Face model directory of `preset`'s shapes: its config.json (all a plan reads), and with
    `weights` Hugging Face's own model of that config saved beside it (what the trainer's --init-from
    checks before it starts)."""
    d = root / f"hf-{preset}"
    d.mkdir(exist_ok=True)
    doc = hf_config_dict(model_config(preset))
    if weights:
        transformers = pytest.importorskip("transformers")
        cfg = transformers.AutoConfig.for_model(**doc)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    (d / "config.json").write_text(json.dumps(doc))
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Every kind of spec: the presets, a config.json, and a model directory with weights of each family."""
    root = tmp_path_factory.mktemp("models")
    specs = {p: p for p in PRESETS}
    for preset in PRESETS:
        specs[f"dir:{preset}"] = str(model_dir(root, preset, weights=True))
    specs["json:llama-tiny"] = str(model_dir(root, "llama-tiny") / "config.json")
    return specs


# --- model_config: a directory reads its config.json ---

@pytest.mark.parametrize("preset", PRESETS)
def test_a_model_directory_reads_its_config_json(tmp_path, preset):
    d = model_dir(tmp_path, preset)
    assert model_config(str(d)) == model_config(str(d / "config.json")) == model_config(preset)
    assert model_config(str(d) + "/") == model_config(preset)


def test_a_directory_without_config_json_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError) as e:
        model_config(str(tmp_path))
    assert str(e.value) == (f"model directory {str(tmp_path)!r} has no config.json (a Hugging Face model "
                            f"directory holds config.json and its safetensors weights)")
    with pytest.raises(ValueError, match="no such model directory or config.json"):
        model_config(str(tmp_path / "missing"))


def test_a_preset_name_wins_over_a_folder_without_config_json(tmp_path, monkeypatch):
    """A folder named gpt2-tiny (of runs, say) in the working directory does not hide the preset;
    one that holds a config.json is a model directory, as in from_pretrained."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2-tiny").mkdir()
    assert model_config("gpt2-tiny") == model_config(PRESETS[0])
    (tmp_path / "gpt2-tiny" / "config.json").write_text(json.dumps(hf_config_dict(model_config("llama-tiny"))))
    assert model_config("gpt2-tiny") == model_config("llama-tiny")


def test_the_trainer_takes_a_model_directory(tmp_path, capsys):
    from train.cli import main as train_main
    d = model_dir(tmp_path, "llama-tiny")
    args = train_parse(["--model", str(d), "--seq", "32"])
    assert model_config(args.model) == model_config("llama-tiny")
    assert train_main(["--model", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: model directory {str(tmp_path)!r} has no config.json (a Hugging Face model directory " \
                  f"holds config.json and its safetensors weights)\n"


# --- the command that runs a plan ---

def trainer_argv(argv: list[str]) -> list[str]:
    """What python -m train receives, from `python -m train ...` or `torchrun ... -m train ...`."""
    i = argv.index("-m")
    assert argv[i + 1] == "train"
    return argv[i + 2:]


def parse_command(argv: list[str], monkeypatch) -> tuple:
    """train/cli.py's parse of a printed command, as it would run on the machine planned for: under
    torchrun with its world, or on cores enough for the ranks."""
    args = trainer_argv(argv)
    with monkeypatch.context() as env:
        if argv[0] == "torchrun":
            world = int(argv[argv.index("--nnodes") + 1]) * int(argv[argv.index("--nproc_per_node") + 1])
            for key, value in (("RANK", "0"), ("WORLD_SIZE", str(world)), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")):
                env.setenv(key, value)
        else:
            world = int(args[args.index("--nproc") + 1])
            env.setattr(os, "cpu_count", lambda: world)
        # a GPU per rank, even for a CPU profile (whose command must pin gloo ranks where a GPU is there):
        # what --device auto and the compile default resolve to
        env.setattr(torch.cuda, "is_available", lambda: True)
        env.setattr(torch.cuda, "device_count", lambda: world)
        return train_parse(args), world


def assert_runs_the_plan(plan: Plan, argv: list[str], monkeypatch) -> None:
    """The parsed command trains `plan`: every setting the trainer has a flag for, as planned. The config
    whole (stage, batch and accumulation, precision, levers, shard group, hpZ, overlap; the plan's default
    AdamW, no clipping, no schedule); model, dropout and sequence; ranks, device; and eager, as the planner
    simulates it (zerofunc/plan/report.py's EAGER_NOTE)."""
    args, world = parse_command(argv, monkeypatch)
    want = plan.zero_config()
    got = args.config
    # compared by what they decide: fp16's section, as the trainer reads it, holds "enabled" (the loss scaler
    # is what it decides); checkpointing "none" holds an unused --ac-every
    assert replace(got, fp16=want.fp16, checkpointing=want.checkpointing) == want
    assert got.loss_scaler() == want.loss_scaler()
    assert got.checkpointing.describe() == want.checkpointing.describe()
    assert world == plan.world_size
    assert args.seq == plan.tokens and model_config(args.model, dropout=args.dropout) == plan.config
    assert args.compile is False  # planned eager; the trainer compiles by default on CUDA
    assert args.device == ("cuda" if plan.profile.device_names else "cpu")
    assert args.data == DATA
    fine_tune = Path(plan.model).is_dir()  # its weights: --init-from, which implies --model
    assert args.init_from == (plan.model if fine_tune else None)
    assert ("--model" in argv) != fine_tune


@st.composite
def plans(draw, models: dict[str, str]) -> Plan:
    hardware = draw(st.sampled_from(["cpu-gloo", "h100-sxm"]))
    stage = draw(st.integers(0, 3))
    ac = draw(st.sampled_from(MODES))
    world = draw(st.integers(1, 4) if hardware == "cpu-gloo" else st.integers(1, 64))
    shard_group = draw(st.none() | st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    group = shard_group or world
    precision = draw(st.sampled_from(sorted(PRECISIONS)))
    return Plan(world_size=world, stage=stage, model=models[draw(st.sampled_from(sorted(models)))],
                precision=precision, reduce_dtype=draw(st.sampled_from([None, precision, "fp32"])),
                micro_batch=draw(st.integers(1, 64)), grad_accum=draw(st.integers(1, 4)),
                shard_group=shard_group,
                hpz=draw(st.none() | st.sampled_from([d for d in range(1, group + 1) if group % d == 0])),
                seq=draw(st.none() | st.integers(1, 256)), hardware=hardware,
                prefetch_depth=draw(st.integers(0, 3)),
                bucket_bytes=draw(st.sampled_from([0, 2**20 // 8, 25 * 2**20, 100 * 2**20 + 2**19])),
                activation_checkpointing=ac, ac_every=draw(st.integers(1, 4)),
                offload_optimizer=stage > 0 and draw(st.booleans()))


def test_every_plans_command_parses_into_its_config(models, monkeypatch):
    every_flag = dict(stage=3, model=models["dir:llama-tiny"], precision="fp16", micro_batch=3, grad_accum=2, seq=32,
                      shard_group=4, hpz=2, prefetch_depth=2, bucket_bytes=2**20, activation_checkpointing="selective",
                      ac_every=3, offload_optimizer=True, reduce_dtype="fp32")  # each a flag; drawn together they are rare

    @settings(max_examples=80, deadline=None)
    @given(plan=plans(models), gpus_per_node=st.none() | st.integers(1, 16))
    @example(plan=Plan(world_size=16, hardware="h100-sxm", **every_flag), gpus_per_node=8)  # torchrun, 2 nodes
    @example(plan=Plan(world_size=8, hardware="cpu-gloo", **every_flag), gpus_per_node=None)
    def prop(plan, gpus_per_node):
        argv = command(plan, gpus_per_node)
        assert_runs_the_plan(plan, argv, monkeypatch)
        launcher = "torchrun" if plan.profile.device_names and plan.world_size > (gpus_per_node or 8) else "python"
        assert argv[0] == launcher

    prop()


@given(st.integers(1, 4096), st.integers(1, 64))
def test_nodes_are_equal_and_fewest(world, per_node):
    n, per = nodes(world, per_node)
    assert n * per == world and per <= per_node
    assert all(world % d for d in range(per + 1, min(world, per_node) + 1))


def test_no_command_for_what_the_trainer_cannot_run():
    assert command(Plan(world_size=2, stage=3, model=None, params=10**6)) is None
    assert command(Plan(world_size=2, stage=3, model=model_config("gpt2-tiny"))) is None


def printed_command(out: str) -> list[str]:
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("to train it"))
    assert f"with {DATA} a directory that python -m train.prepare wrote" in lines[i]
    return shlex.split(lines[i + 1])


def test_the_planner_plans_a_model_directory_and_prints_its_fine_tune(models, capsys, monkeypatch):
    """Levers fixed: the table's command carries each of them, and runs the plan of its recommendation."""
    d = models["dir:llama-tiny"]
    flags = ["--model", d, "--world-size", "2", "--stage", "3", "--seq", "64", "--micro-batch", "2",
             "--hardware", "cpu-gloo", "--levers", "none", "--activation-checkpointing", "selective", "--ac-every", "2",
             "--offload-optimizer", "cpu", "--prefetch-depth", "2", "--bucket-mb", "12.5"]
    assert plan_main(flags) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{d} (") and "recommended: stage 3 on 2 ranks" in out
    argv = printed_command(out)
    assert argv[:5] == ["python", "-m", "train", "--init-from", d]
    plan = Plan(world_size=2, stage=3, model=d, micro_batch=2, seq=64, hardware="cpu-gloo", prefetch_depth=2,
                bucket_bytes=int(12.5 * 2**20), activation_checkpointing="selective", offload_optimizer=True)
    assert_runs_the_plan(plan, argv, monkeypatch)


def test_the_json_names_the_command_of_the_searched_recommendation(models, capsys, monkeypatch):
    """--levers auto: the micro-batch and levers the search chose are the command's."""
    d = models["dir:gpt2-tiny"]
    assert plan_main(["--model", d, "--world-size", "2", "--stage", "3", "--seq", "32",
                      "--hardware", "cpu-gloo", "--gpu-memory", "0.02", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["recommended"]
    assert doc["model"] == d and best is not None
    plan = Plan(world_size=best["world_size"], stage=best["stage"], model=d, micro_batch=best["micro_batch"], seq=32,
                hardware="cpu-gloo", activation_checkpointing=best["activation_checkpointing"],
                ac_every=best["ac_every"] or 2, offload_optimizer=best["offload_optimizer"] == "cpu")
    assert_runs_the_plan(plan, doc["recommended_command"], monkeypatch)


def test_a_preset_prints_the_same_command_with_model(capsys, monkeypatch):
    assert plan_main(["--model", "gpt2-tiny", "--world-size", "16", "--stage", "1", "--seq", "128",
                      "--micro-batch", "4", "--levers", "none", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "to train it, on each of 4 nodes (HOST0: any one of them)" in out
    argv = printed_command(out)
    assert argv[:5] == ["torchrun", "--nnodes", "4", "--nproc_per_node", "4"]
    assert_runs_the_plan(Plan(world_size=16, stage=1, model="gpt2-tiny", micro_batch=4, seq=128), argv, monkeypatch)


def test_a_directory_without_config_json_is_a_usage_error(tmp_path, capsys):
    assert plan_main(["--model", str(tmp_path), "--world-size", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"error: model directory {str(tmp_path)!r} has no config.json")
    with pytest.raises(UsageError, match="has no config.json"):
        train_parse(["--model", str(tmp_path)])
