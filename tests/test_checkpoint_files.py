"""A checkpoint on disk read without an engine: one written with another padding than today's layout; one
read range by range as --init-from reads it, each rank hashing only the files it reads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zerofunc import checkpoint_files, pretrained
from zerofunc.checkpoint_files import FORMAT, consolidated, rank_file, sha256
from zerofunc.layout import FlatLayout


def test_a_checkpoint_padded_the_old_way_consolidates(tmp_path):
    """Before shards were padded to 16 elements, 11 elements on 3 ranks made shards of 4 (12 in
    all; today's layout makes 48). The parameters sit at the same offsets either way, so the
    consolidated weights are the saved ones, exactly."""
    params = [["a", [5]], ["b", [2, 3]]]
    a, b = torch.arange(5, dtype=torch.float32), torch.arange(6, dtype=torch.float32).view(2, 3) + 10
    flat = torch.cat([a, b.flatten(), torch.zeros(1)])  # 12 = 3 shards of 4
    assert FlatLayout.build(params, 3).padded_numel != flat.numel()  # the layout has changed since
    files = []
    for r in range(3):
        files.append(rank_file(r))
        shard = flat[4 * r:4 * (r + 1)].clone()
        save_file({"0.master": shard, "0.m": torch.zeros(4), "0.v": torch.zeros(4)}, str(tmp_path / files[-1]))
    manifest = {"format": FORMAT, "step": 1, "optimizer_steps": 1, "world_size": 3, "stage": 2, "files": files,
                "sha256": {f: sha256(tmp_path / f) for f in files},
                "units": [{"name": "", "numel": 11, "padded_numel": 12, "params": params}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    weights = consolidated(tmp_path)
    assert torch.equal(weights["a"], a) and torch.equal(weights["b"], b)


def two_file_checkpoint(path, params: list, model: str | None = None) -> Path:
    """A zerofunc checkpoint of 2 rank files holding one unit of `params` ([name, shape] pairs), laid out as
    zerofunc/checkpoint.py saves one (today's padding), each element its index / 1000."""
    path.mkdir(parents=True)
    layout = FlatLayout.build(params, 2)
    flat, half = torch.arange(layout.padded_numel, dtype=torch.float32) / 1000, layout.padded_numel // 2
    files = [rank_file(r) for r in range(2)]
    for r, f in enumerate(files):
        save_file({f"0.{kind}": flat[r * half:(r + 1) * half].clone() for kind in ("master", "m", "v")}, str(path / f))
    manifest = {"format": FORMAT, "step": 1, "optimizer_steps": 1, "world_size": 2, "stage": 3, "files": files,
                "sha256": {f: sha256(path / f) for f in files}, "extra": {"model": model},
                "units": [{"name": "", "numel": layout.numel, "padded_numel": layout.padded_numel, "params": params}]}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def flip_last_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


def test_a_rank_hashes_only_the_checkpoint_files_it_reads(tmp_path, monkeypatch):
    """A checkpoint of 2 files: reading `a` (all in file 0) hashes file 0 alone, so a corrupt file 1 is
    found only by a reader of `b`, which spans both (planted: hashing every file before the first read,
    64 ranks each reading a whole 70B checkpoint, fails the read of `a`)."""
    ckpt = two_file_checkpoint(tmp_path / "ckpt", [["a", [6]], ["b", [4, 5]]])
    flip_last_byte(ckpt / rank_file(1))
    hashed, whole = [], checkpoint_files.sha256
    monkeypatch.setattr(checkpoint_files, "sha256", lambda f: hashed.append(f.name) or whole(f))
    source = pretrained.CheckpointWeights(ckpt)
    assert torch.equal(source("a", (6,)), torch.arange(6, dtype=torch.float32) / 1000)
    assert hashed == [rank_file(0)]
    with pytest.raises(pretrained.WeightsError, match=f"{rank_file(1)} does not match the checksum"):
        source("b", (4, 5))
    assert hashed == [rank_file(0), rank_file(1)]
