"""--init-from through the trainer (train/cli.py): weights that do not fit the model are one line naming
the tensor and the file, exit 2, nothing trained; a zerofunc run directory starts a fine-tune.

A model directory may be hostile: its weight map naming files outside it, links leading out, a header
claiming gigabytes, a corrupt checkpoint file found only in a rank. Each is one line, exit 2, no traceback,
and nothing outside the directory is opened (`opened` watches every open, Python's and safetensors')."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_dirs import save_hf_dir
from tests.test_checkpoint_files import flip_last_byte, two_file_checkpoint
from zerofunc import hf_files, pretrained
from zerofunc.checkpoint_files import rank_file
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


class Opened:
    """The files opened while a test watches, links followed: by anyone, and by safetensors."""

    def __init__(self):
        self.files: list[str] = []
        self.by_safetensors: list[str] = []


_watching: Opened | None = None
_hooked = False


def _audit(event: str, args) -> None:
    if event == "open" and _watching is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _watching.files.append(os.path.realpath(os.fsdecode(args[0])))


@pytest.fixture
def opened(monkeypatch):
    """Every file opened while the test runs: Python's opens (an audit hook, added once: hooks cannot be
    removed) and safetensors' own (it opens files in Rust, so its safe_open is wrapped)."""
    global _watching, _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    safe_open, watching = hf_files.safe_open, Opened()

    def watched(path, *args, **kwargs):
        watching.files.append(os.path.realpath(path))
        watching.by_safetensors.append(os.path.realpath(path))
        return safe_open(path, *args, **kwargs)

    monkeypatch.setattr(hf_files, "safe_open", watched)
    _watching = watching
    yield watching
    _watching = None


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


def config_says_false_as_a_string(path):
    config = path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tie_word_embeddings": "false"}))
    return ["config.json", "'tie_word_embeddings' must be true or false, got 'false'"]


@pytest.mark.parametrize("spoil", [missing_tensor, unexpected_tensor, wrong_shape, unreadable_file,
                                   index_to_missing_file, config_says_false_as_a_string])
def test_a_mismatch_is_one_line_and_nothing_trains(capsys, tmp_path, llama_dir, spoil):
    """Checked in the launcher, before any rank starts (planted: dropping the unexpected-tensor check
    trains on, exit 0)."""
    names = spoil(llama_dir)
    out = tmp_path / "run"
    rc, err = run_train(capsys, "--init-from", str(llama_dir), "--steps", "2", "--seq", "8", "--out", str(out))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert all(n in err for n in names), (names, err)
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("bound", [None, 64])
def test_a_header_s_length_is_bounded_before_safetensors_reads_it(capsys, monkeypatch, tmp_path, llama_dir,
                                                                   tiny_data, opened, bound):
    """A shard's first 8 bytes, its header's length, are checked before safetensors opens it: against the
    file's size, and against a bound (lowered here: a real header is ~100 bytes a tensor). Planted: without
    the check, safetensors' own HeaderTooLarge answers, and safe_open is seen opening the file."""
    f = sorted(llama_dir.glob("model-*.safetensors"))[0]  # the first one opened
    if bound is None:
        f.write_bytes((1 << 62).to_bytes(8, "little") + f.read_bytes()[8:])
        claim = f"its header claims {1 << 62} bytes, more than the file holds"
    else:
        monkeypatch.setattr(hf_files, "MAX_HEADER_BYTES", bound)
        claim = f"its header claims {int.from_bytes(f.read_bytes()[:8], 'little')} bytes, more than the bound of 64"
    rc, err = run_train(capsys, "--init-from", str(llama_dir), "--steps", "1", "--seq", "8", "--data", tiny_data,
                        "--out", str(tmp_path / "run"))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and f.name in err and claim in err, err
    assert str(f.resolve()) not in opened.by_safetensors


# ---- a weight map that leads out of the model directory -------------------------------------------------

def copied_out(path) -> tuple[str, Path]:
    """The shard holding model.norm.weight, copied outside the model directory: what a map that leads
    out would load, were it followed (planted: it is, and the run trains, exit 0)."""
    f = shard_holding(path, "model.norm.weight")
    target = path.parent / "elsewhere" / f.name
    target.parent.mkdir()
    shutil.copy(f, target)
    return f.name, target


def map_shard_to(path, shard: str, name: str) -> None:
    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: name if v == shard else v for k, v in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))


def names_a_parent_path(path):
    shard, target = copied_out(path)
    map_shard_to(path, shard, f"../elsewhere/{shard}")
    return target, [f"'../elsewhere/{shard}'", "not a plain file name"]


def names_an_absolute_path(path):
    shard, target = copied_out(path)
    map_shard_to(path, shard, str(target))
    return target, [f"'{target}'", "not a plain file name"]


def names_a_host_file(path):
    """Once answered "header too large", which told that the file exists."""
    map_shard_to(path, shard_holding(path, "model.norm.weight").name, "/etc/passwd")
    return Path("/etc/passwd"), ["'/etc/passwd'", "not a plain file name"]


def links_out(path):
    shard, target = copied_out(path)
    (path / shard).unlink()
    (path / shard).symlink_to(Path("..") / "elsewhere" / shard)
    return target, [shard, "which leads out of"]


def links_out_to_nothing(path):
    """The answer of a link out must not tell whether its target exists (planted: "does not exist")."""
    target, names = links_out(path)
    target.unlink()
    return target, names


@pytest.mark.parametrize("escape", [names_a_parent_path, names_an_absolute_path, names_a_host_file, links_out,
                                    links_out_to_nothing])
def test_a_weight_map_leading_out_of_the_directory_is_refused_before_any_file_is_opened(
        capsys, tmp_path, llama_dir, tiny_data, opened, escape):
    target, names = escape(llama_dir)
    opened.files.clear()  # building the directory is not loading it
    rc, err = run_train(capsys, "--init-from", str(llama_dir), "--steps", "1", "--seq", "8", "--data", tiny_data,
                        "--out", str(tmp_path / "run"))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and all(n in err for n in names), err
    assert str(target.resolve()) not in opened.files
    assert not [f for f in opened.files if f.endswith(".safetensors")], "every name is checked before any open"


def test_a_hugging_face_cache_snapshot_s_links_to_its_own_blobs_are_followed(tmp_path, llama_dir):
    """The Hub's cache keeps each file once, in models--org--name/blobs/, and a snapshot's files link there
    (planted: refusing every link out refuses this, the commonest model directory there is)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(llama_dir.iterdir()):
        f.rename(blobs / f"blob-{f.name}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob-{f.name}")
    assert pretrained.weights(snapshot, meta_model(str(snapshot))).files
    (snapshot / "model.safetensors.index.json").unlink()  # a link to another repository's blobs is refused
    (snapshot / "model.safetensors.index.json").symlink_to(tmp_path / "hub" / "models--a--b" / "blobs" / "x")
    with pytest.raises(pretrained.WeightsError, match="is a link that leads out of"):
        pretrained.weights(snapshot, meta_model(str(snapshot)))


# ---- a zerofunc checkpoint: each rank hashes the files it reads (and tests/test_checkpoint_files.py) -------

@pytest.mark.slow
def test_a_corrupt_checkpoint_file_found_in_a_rank_is_one_line(capsys, tmp_path, tiny_data):
    """The checksum is checked by the rank that reads the file, not in the launcher (which would read the
    whole checkpoint), and a mismatch is still the user's input: one line, exit 2 (planted: the rank's
    traceback, as for a bug, exit 1)."""
    params = [[n, list(p.shape)] for n, p in meta_model("gpt2-tiny").named_parameters()]
    ckpt = two_file_checkpoint(tmp_path / "ckpt", params, model="gpt2-tiny")
    flip_last_byte(ckpt / rank_file(1))
    rc, err = run_train(capsys, "--init-from", str(ckpt), "--nproc", "1", "--steps", "1", "--seq", "8",
                        "--data", tiny_data, "--out", str(tmp_path / "run"))
    assert rc == 2 and err.count("\n") == 1 and f"{rank_file(1)} does not match the checksum" in err, err


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
