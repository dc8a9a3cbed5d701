"""Checkpoints of frozen weights (issue 32): resumed bit for bit at another world size and stage, saved in the
rank files when they came from nowhere else, and recorded by file and SHA-256, not saved, when they were read
from pretrained files (zerofunc/frozen_source.py), so that a LoRA checkpoint costs about its adapters.

Bit for bit is the bound, not a tolerance: a frozen weight is stored in the compute dtype and copied, never
computed, so any difference is a wrong element. The loading engines start from other weights (every
parameter moved by 1) so that nothing right can come from their own initialization."""
from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

import zerofunc
from tests.bare import in_world
from tests.steps import recorded_steps
from tests.modules import OPTIM, batches
from tests.test_checkpoint_files import flip_last_byte
from tests.test_frozen import frozen_model
from zerofunc import checkpoint
from zerofunc.checkpoint_files import consolidated, resolve

pytestmark = pytest.mark.slow


def _engine(stage: int, precision: str, moved: bool):
    model = frozen_model("tokens")
    if moved:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "optimizer": OPTIM}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return zerofunc.initialize(model, config)


def _state(engine):
    m, v = engine.full_moments()
    return engine.full_parameters(), m, v, engine.state.steps


def _save(stage: int, precision: str, run: str) -> None:
    engine = _engine(stage, precision, moved=False)
    recorded_steps(engine, lambda rows, gen: batches("tokens", rows, gen), steps=2, seed=1)
    checkpoint.save(engine, run, 2)
    state = _state(engine)
    if engine.comm.rank == 0:  # tensors go back through a file: a rank's shared-memory handles end with it
        torch.save(state, f"{run}/before.pt")


def _load(stage: int, precision: str, run: str) -> tuple[list[str], int, int]:
    """The names whose weight or moments differ from the saved ones, and the step counts (saved, loaded)."""
    engine = _engine(stage, precision, moved=True)
    checkpoint.load(engine, run)
    after, before = _state(engine), torch.load(f"{run}/before.pt")
    bad = [n for got, want in zip(after[:3], before[:3]) for n in want.keys() | got.keys()
           if n not in got or n not in want or not torch.equal(got[n], want[n])]
    return bad, before[3], after[3]


@pytest.mark.parametrize("saved, loaded", [((3, 3, "bf16"), (1, 2, "bf16")), ((0, 2, "fp32"), (3, 3, "fp32"))],
                         ids=["stage 3 x 3 to stage 1 x 2, bf16", "stage 0 x 2 to stage 3 x 3, fp32"])
def test_frozen_weights_resume_bit_for_bit_at_another_world_size_and_stage(tmp_path, saved, loaded):
    """Frozen weights with no source are saved with the checkpoint, in the compute dtype, each file its span;
    loaded at another world size and stage every parameter (frozen and trained), both moments and the step
    count are those saved, bit for bit."""
    stage, world, precision = saved
    in_world(world, _save, stage, precision, str(tmp_path))
    stage, world, precision = loaded
    bad, steps_saved, steps_loaded = in_world(world, _load, stage, precision, str(tmp_path))[0]
    assert not bad, bad
    assert steps_loaded == steps_saved == 2
    frozen = {n for n, p in frozen_model("tokens").named_parameters() if not p.requires_grad}
    before = torch.load(tmp_path / "before.pt")
    assert frozen and frozen <= set(before[0]) and frozen.isdisjoint(before[1])
    manifest = json.loads((resolve(tmp_path) / "manifest.json").read_text())
    assert manifest["frozen_source"] is None
    dtypes = {u["frozen"]["dtype"] for u in manifest["units"] if "frozen" in u}
    assert dtypes == {"bfloat16" if saved[2] == "bf16" else "float32"}


needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers")


def _train(capsys, *argv) -> tuple[int, str]:
    from train.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def _file_value(source: dict, key_of: list) -> torch.Tensor:
    f, key, transposed = key_of
    with safe_open(f"{source['path']}/{f}", framework="pt") as h:
        t = h.get_tensor(key)
    return t.t() if transposed else t


def _ours(run, base):
    """Our model of a `--lora 4` run: the base's architecture with its adapters, the consolidated weights."""
    from zerofunc.lora import LoRA, apply_lora
    from zerofunc.models import build_model, model_config

    model = build_model(model_config(str(base / "config.json")))
    apply_lora(model, LoRA(4))
    model.load_state_dict(consolidated(run), strict=True)
    return model.eval()


def _same_logits(model, theirs) -> None:
    """Hugging Face's (or PEFT's) model of an export gives our model's logits within tests/test_export.py's TOL,
    in fp32 and in fp64. Merging rounds each weight once in fp32, which moves the logits by about the fp32
    forward's own rounding r (measured here as ours in fp32 against ours in fp64), so both must agree within
    TOL >= 2r; the adapters (after 3 steps) move the logits by far more than TOL, so an export without them,
    or with them unscaled, fails."""
    from tests.test_export import TOL

    x = torch.randint(0, model.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours32, theirs32 = model(x), theirs(input_ids=x).logits
        ours64, theirs64 = model.double()(x), theirs.double()(input_ids=x).logits
        rounding = (ours32 - ours64).abs().max().item()
        assert 2 * rounding <= TOL, f"fp32 rounding of {rounding:.1e} leaves no room under {TOL}"
        adapters = (ours64 - _without_adapters(model)(x)).abs().max().item()
    assert adapters > 100 * TOL, f"the adapters move the logits by {adapters:.1e} only: the test would not see them"
    for got, want in ((theirs32, ours32), (theirs64, ours64)):
        assert (got - want).abs().max().item() <= TOL, (got - want).abs().max().item()


def _merged_export_gives_the_trainers_logits(run, base, out) -> None:
    """`consolidate --hf` of a LoRA run writes the base architecture with W + (alpha / r) B A, merged in fp32:
    Hugging Face's model of it gives the logits of ours with the adapters (`_same_logits`)."""
    from tests.test_export import load_hf
    from zerofunc.consolidate import main as consolidate

    assert consolidate([str(run), str(out), "--hf", "--max-shard-size", "100KB"]) == 0
    _same_logits(_ours(run, base), load_hf(out))


def _peft_loads_the_adapter_and_gives_the_trainers_logits(run, base, out, conv1d: bool) -> None:
    """`consolidate --adapter` writes PEFT's adapter directory: `PeftModel.from_pretrained` on the base model
    loads every adapter it holds (and no other), with the run's r, alpha and targets, and gives our logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from zerofunc.consolidate import main as consolidate

    assert consolidate([str(run), str(out), "--adapter"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == ("LORA", 4, 8.0, conv1d)
    assert config["base_model_name_or_path"] == str(base.resolve())
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as h:
        assert h.metadata() == {"format": "pt"}
        saved = {k: h.get_tensor(k) for k in h.keys()}
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), out).eval()
    loaded = peft.get_peft_model_state_dict(theirs)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    _same_logits(_ours(run, base), theirs)


def _without_adapters(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B.weight"):
                p.zero_()
    return model


def _loaded_frozen_differs(config: str, run: str) -> list[str]:
    """The frozen weights that differ from their files after `checkpoint.load` into a stage-3 engine whose own
    weights are all zero: the engine's, not the checkpoint's view of them (which `consolidated` reads)."""
    from zerofunc.lora import LoRA, apply_lora
    from zerofunc.models import build_model, model_config

    with torch.device("meta"):
        model = build_model(model_config(config))
    apply_lora(model, LoRA(4))
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                         "optimizer": OPTIM}, init=lambda name, shape: torch.zeros(shape))
    source = checkpoint.load(engine, run)["frozen_source"]
    full = engine.full_parameters()
    return [n for n, where in source["keys"].items() if not torch.equal(full[n], _file_value(source, where).float())]


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_a_lora_checkpoint_records_its_base_files_and_resumes_from_them(tmp_path, capsys, tiny_data, family):
    """`--init-from DIR --lora 4` at stage 3 on 2 ranks saves no frozen weight: the manifest records each file of
    DIR by SHA-256 and each frozen parameter by file and key. Resumed at stage 1 on 3 ranks, the run reads them
    back from DIR, and the checkpoint it saves then records the same files: every frozen weight is the file's,
    bit for bit. Both exports give the trainer's logits: `--hf` merged, `--adapter` through PEFT (GPT-2's
    Conv1D with fan_in_fan_out). For the Llama, a changed file is refused in one line (a rank hashes it), a
    missing one before any rank starts; neither trains a step."""
    from tests.hf_dirs import save_hf_dir

    base = save_hf_dir(family, tmp_path / family)
    run = tmp_path / "run"
    common = ["--init-from", str(base), "--lora", "4", "--seq", "32", "--data", tiny_data, "--out", str(run)]
    rc, err = _train(capsys, *common, "--stage", "3", "--nproc", "2", "--steps", "2", "--save-every", "2")
    assert rc == 0, err
    manifest = json.loads((resolve(run) / "manifest.json").read_text())
    source = manifest["frozen_source"]
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(source["sha256"]) == shards
    assert source["sha256"] == {f: hashlib.sha256((base / f).read_bytes()).hexdigest() for f in shards}
    for f in manifest["files"]:
        with safe_open(str(resolve(run) / f), framework="pt") as h:
            assert not [k for k in h.keys() if k.endswith(".frozen")]

    rc, err = _train(capsys, *common, "--stage", "1", "--nproc", "3", "--steps", "3", "--save-every", "1",
                     "--resume")
    assert rc == 0, err
    after = json.loads((resolve(run) / "manifest.json").read_text())
    assert after["step"] == 3 and after["frozen_source"] == source
    weights = consolidated(run)
    frozen = [n for u in after["units"] if "frozen" in u for n, _ in u["frozen"]["params"]]
    assert frozen and set(frozen) == set(source["keys"])
    bad = [n for n in frozen if not torch.equal(weights[n], _file_value(source, source["keys"][n]).float())]
    assert not bad, bad
    assert in_world(2, _loaded_frozen_differs, str(base / "config.json"), str(run)) == [[], []]
    _merged_export_gives_the_trainers_logits(run, base, tmp_path / "merged")
    _peft_loads_the_adapter_and_gives_the_trainers_logits(run, base, tmp_path / "adapter", family == "gpt2")
    if family != "llama":
        return

    flip_last_byte(base / shards[0])  # the same size: only its hash tells
    rc, err = _train(capsys, *common, "--stage", "3", "--nproc", "2", "--steps", "4", "--resume")
    assert rc == 2 and err.startswith("error: ") and "\n" not in err.strip(), err
    assert "changed since the checkpoint was saved" in err and str(base / shards[0]) in err, err
    flip_last_byte(base / shards[0])
    (base / shards[-1]).rename(tmp_path / "elsewhere.safetensors")
    rc, err = _train(capsys, *common, "--stage", "3", "--nproc", "2", "--steps", "4", "--resume")
    assert rc == 2 and err.startswith("error: ") and "is missing" in err and "\n" not in err.strip(), err
    assert json.loads((resolve(run) / "manifest.json").read_text())["step"] == 3
