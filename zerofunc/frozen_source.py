"""Where a checkpoint's frozen weights are: the pretrained files they were read from, instead of the checkpoint.

A LoRA fine-tune of a 70B model freezes 141 GB of bf16 weights that never change. Saved with every
checkpoint they would make each one that size, for weights already on disk. So when every frozen
parameter was read from safetensors files (`--init-from DIR`, zerofunc/pretrained.py), a checkpoint
records where instead (its manifest's "frozen_source"):

    {"path": "/abs/model/dir", "sha256": {"model-00001-of-00002.safetensors": "…", …}, "bytes": {…},
     "keys": {"<our parameter name>": ["<file>", "<tensor key in it>", <stored transposed>], …}}

and a load reads the frozen weights back from those files, after it has checked their SHA-256: a
changed or missing file is a `CheckpointError` in one line, never other weights. Frozen weights
with no such source (a model frozen by hand, random weights) are saved in the rank files instead
(zerofunc/checkpoint.py). The record needs no model to be read: `consolidated` uses it too.

Files are hashed at the first save, split over the ranks (each hashes every world-th file), and a
hash is reused while the file's size and modification time stay those it was hashed at.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from zerofunc.checkpoint_files import CheckpointError, sha256
from zerofunc.hf_files import open_safetensors, read_range

# path: (size, mtime_ns, SHA-256), for this process
_hashed: dict[str, tuple[int, int, str]] = {}


def locate(init, names: Sequence[str]) -> Optional[dict]:
    """The record of `names`' source (without hashes: `hashed` adds them), or None when `init` is not a
    file source (it has no `locate`) or does not hold every one of them."""
    find: Optional[Callable] = getattr(init, "locate", None)
    if find is None or not names:
        return None
    keys = {}
    for name in names:
        where = find(name)
        if where is None:
            return None
        path, key, transposed = where
        keys[name] = [str(Path(path).resolve()), key, transposed]
    root = os.path.commonpath([p for p, _, _ in keys.values()])
    root = root if Path(root).is_dir() else str(Path(root).parent)
    return {"path": root, "keys": {n: [os.path.relpath(p, root), k, t] for n, (p, k, t) in keys.items()}}


def files(record: dict) -> list[str]:
    return sorted({f for f, _, _ in record["keys"].values()})


def _sha256(path: Path) -> str:
    st = path.stat()
    known = _hashed.get(str(path))
    if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
        return known[2]
    digest = sha256(path)
    _hashed[str(path)] = (st.st_size, st.st_mtime_ns, digest)
    return digest


def hash_share(record: dict, rank: int, world: int) -> dict[str, str]:
    """The SHA-256 of this rank's share of the record's files (every world-th, from the rank's)."""
    return {f: _sha256(Path(record["path"]) / f) for f in files(record)[rank::world]}


def _missing(path: Path) -> CheckpointError:
    return CheckpointError(f"the frozen weights' source {path} is missing (the checkpoint does not hold them: "
                           "put the file back)")


def _changed(path: Path) -> CheckpointError:
    return CheckpointError(f"the frozen weights' source {path} changed since the checkpoint was saved "
                           "(its SHA-256 differs)")


def check_present(record: dict) -> None:
    """Every file of the record there, at its recorded size: what can be checked before a run starts without
    reading a 141 GB model (the ranks' load hashes the files, each its share)."""
    for f in files(record):
        path = Path(record["path"]) / f
        if not path.is_file():
            raise _missing(path)
        if path.stat().st_size != record["bytes"][f]:
            raise _changed(path)


def check_file(record: dict, f: str) -> None:
    """File `f` of the record against the hash recorded with it."""
    path = Path(record["path"]) / f
    if not path.is_file():
        raise _missing(path)
    if _sha256(path) != record["sha256"][f]:
        raise _changed(path)


def check_share(record: dict, rank: int, world: int) -> None:
    """This rank's share of the record's files against the hashes recorded with it."""
    for f in files(record)[rank::world]:
        check_file(record, f)


class SourceReader:
    """Elements of a recorded frozen parameter, read from its file: checked first, unless the caller has
    (`checked`: each rank its share, then all agree)."""

    def __init__(self, record: dict, checked: bool = False):
        self.record, self.checked = record, checked
        self._handles: dict[str, object] = {}

    def read_into(self, name: str, shape: tuple[int, ...], lo: int, hi: int, out: torch.Tensor, memory) -> None:
        f, key, transposed = self.record["keys"][name]
        if f not in self._handles:
            if not self.checked:
                check_file(self.record, f)
            self._handles[f] = open_safetensors(Path(self.record["path"]) / f)
        read_range(self._handles[f], key, tuple(shape), lo, hi, transposed, out, memory)
