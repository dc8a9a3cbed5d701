"""A checkpoint on disk read without an engine: one written with another padding than today's layout."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

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
