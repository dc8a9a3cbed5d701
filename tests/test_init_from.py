"""--init-from through the trainer (train/cli.py): weights that do not fit the model are one line naming
the tensor and the file, exit 2, nothing trained; a zerofunc run directory starts a fine-tune."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_dirs import save_hf_dir
from zerofunc import pretrained
from zerofunc.models import build_model, model_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def meta_model(spec: str):
    with torch.device("meta"):
        return build_model(model_config(spec))


def run_train(capsys, *argv) -> tuple[int, str]:
    from train.cli import main

    capsys.readouterr()  # what building the files printed
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture
def llama_dir(tmp_path):
    return save_hf_dir("llama", tmp_path / "llama")


def shard_holding(path, key: str):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]


def rewrite(file, change) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def missing_tensor(path):
    key = "model.layers.1.mlp.up_proj.weight"
    f = shard_holding(path, key)
    rewrite(f, lambda t: t.pop(key))
    return [key, f.name]


def unexpected_tensor(path):
    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.layers.0.extra.weight"] = doc["weight_map"]["lm_head.weight"]
    index.write_text(json.dumps(doc))
    rewrite(shard_holding(path, "lm_head.weight"), lambda t: t.update({"model.layers.0.extra.weight": torch.ones(3)}))
    return ["model.layers.0.extra.weight", shard_holding(path, "lm_head.weight").name]


def wrong_shape(path):
    key = "model.norm.weight"
    rewrite(shard_holding(path, key), lambda t: t.update({key: torch.ones(7)}))
    return [key, shard_holding(path, key).name, "[7]", "[40]"]


def unreadable_file(path):
    f = shard_holding(path, "model.embed_tokens.weight")
    f.write_bytes(f.read_bytes()[:20])
    return [f.name]


def index_to_missing_file(path):
    f = shard_holding(path, "model.norm.weight")
    f.unlink()
    return [f.name, "does not exist"]


@pytest.mark.parametrize("spoil", [missing_tensor, unexpected_tensor, wrong_shape, unreadable_file,
                                   index_to_missing_file])
def test_a_mismatch_is_one_line_and_nothing_trains(capsys, tmp_path, llama_dir, spoil):
    """Checked in the launcher, before any rank starts (planted: dropping the unexpected-tensor check
    trains on, exit 0)."""
    names = spoil(llama_dir)
    out = tmp_path / "run"
    rc, err = run_train(capsys, "--init-from", str(llama_dir), "--steps", "2", "--seq", "8", "--out", str(out))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert all(n in err for n in names), (names, err)
    assert not (out / "metrics.jsonl").exists()


def test_a_lone_file_needs_a_model_and_a_wrong_model_is_named(capsys, tmp_path, llama_dir):
    lone = shard_holding(llama_dir, "model.norm.weight")
    rc, err = run_train(capsys, "--init-from", str(lone), "--out", str(tmp_path / "a"))
    assert rc == 2 and "give --model" in err, err
    rc, err = run_train(capsys, "--init-from", str(llama_dir), "--model", "gpt2-tiny", "--out", str(tmp_path / "b"))
    assert rc == 2 and err.count("\n") == 1 and "wte.weight" in err and "index.json" in err, err


@pytest.mark.slow
def test_a_zerofunc_checkpoint_starts_a_fine_tune(tmp_path, capsys, tiny_data):
    """--init-from a run directory: its newest checkpoint's fp32 weights, read across its 2 rank files,
    equal the consolidated ones; a 3-rank run starts from them with the model the checkpoint names."""
    from zerofunc.checkpoint_files import consolidated

    run = tmp_path / "run"
    rc, _ = run_train(capsys, "--steps", "2", "--seq", "16", "--save-every", "2", "--data", tiny_data,
                      "--out", str(run))
    assert rc == 0
    assert pretrained.model_spec(run) == "gpt2-tiny"
    model = meta_model("gpt2-tiny")
    source = pretrained.weights(run, model)
    for name, w in consolidated(run).items():
        assert torch.equal(source(name, tuple(w.shape)), w), name
    rc, err = run_train(capsys, "--init-from", str(run), "--nproc", "3", "--steps", "1", "--seq", "16",
                        "--data", tiny_data, "--out", str(tmp_path / "tuned"))
    assert rc == 0, err
