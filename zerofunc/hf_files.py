"""A Hugging Face model directory's weight files: which file holds each tensor, and opening one.

A model directory may come from anyone, so nothing here reads outside it:

- the names in `model.safetensors.index.json`'s weight map are plain file names (no directory
  part, not absolute) of regular files in the directory; a symbolic link is followed only while
  it stays inside. The one exception is Hugging Face's own cache, where each file of a snapshot
  (`models--org--name/snapshots/REV/`) links to `models--org--name/blobs/HASH`: links into the
  same repository's blobs are followed. Every name is checked before any file is opened, and
  the refusal reads the same whether or not the target exists, so the map cannot probe the host;
- a safetensors header's length (its first 8 bytes) is checked against the file's size and a
  bound before safetensors reads it, so a corrupt or hostile length is one line, not an
  allocation or a read of gigabytes; so is the index's size.

Each refusal is a `WeightsError` whose message is one line.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors' own bound on a header (MAX_HEADER_SIZE, 100 MB); a real one is ~100 bytes per tensor
MAX_HEADER_BYTES = 100_000_000
# the index of a 405B model is ~100 KB
MAX_INDEX_BYTES = 16 << 20


class WeightsError(ValueError):
    """Pretrained weights that do not fit the model, or cannot be read; the message is one line."""

    bad_input = True  # found in a rank too (a checksum), it is still the user's file: one line, exit 2


def open_safetensors(path: Path):
    """safetensors' handle on `path`, once its header's length has been found plausible."""
    try:
        with open(path, "rb") as f:
            head, size = f.read(8), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise WeightsError(f"cannot read {path}: no such file") from None
    except OSError as e:
        raise WeightsError(f"cannot read {path}: {e.strerror}") from None
    if len(head) < 8:
        raise WeightsError(f"cannot read {path}: {size} bytes, too short for a safetensors file")
    length = int.from_bytes(head, "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise WeightsError(f"cannot read {path}: its header claims {length} bytes, more than "
                           f"{'the file holds' if length > size - 8 else f'the bound of {MAX_HEADER_BYTES}'}")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors' own errors: a truncated or corrupt header
        raise WeightsError(f"cannot read {path}: {type(e).__name__}: {e}") from None


def inside(directory: Path, f: Path) -> bool:
    """Whether `f`, its links followed, lies in `directory` (or a Hugging Face cache snapshot's blobs).
    Only names are resolved (readlink), nothing is opened."""
    try:
        root, real = directory.resolve(), f.resolve()
    except (OSError, RuntimeError):  # a loop of links
        return False
    return real.is_relative_to(root) or (root.parent.name == "snapshots"
                                         and real.parent == root.parent.parent / "blobs")


def _plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and name.isprintable()
            and not any(c in name for c in "/\\") and os.path.basename(name) == name)


def _in_directory(p: Path, name: str, what: str) -> Path:
    """p / name, once it is known to lie inside p (checked first, so that the answer does not
    depend on whether a target outside exists) and to be a regular file."""
    f = p / name
    if not inside(p, f):
        raise WeightsError(f"{what}, which leads out of {p}")
    if not f.is_file():
        raise WeightsError(f"{what}, which does not exist")
    return f


def _read_index(index: Path) -> dict:
    try:
        size = index.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise WeightsError(f"{index} holds {size} bytes; an index is at most {MAX_INDEX_BYTES}")
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise WeightsError(f"cannot read {index}: {type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index}: weight_map is not an object")
    return weight_map


def weight_files(path: str | Path) -> dict[str, Path]:
    """Each tensor's file: from the index of a sharded directory, or the header of one file."""
    p = Path(path)
    if p.is_dir():
        index = p / INDEX
        if os.path.lexists(index):  # lexists: a link's target is not looked at before it is known to be inside
            if not inside(p, index):
                raise WeightsError(f"{index} is a link that leads out of {p}")
            weight_map = _read_index(index)
            files = {}
            for key, name in weight_map.items():  # every name, before any file is opened
                if not _plain_name(name):
                    raise WeightsError(f"{index} maps tensor {key} to {name!r}, not a plain file name in {p}")
                files[key] = _in_directory(p, name, f"{index} maps tensor {key} to {name}")
            for f in sorted(set(files.values())):  # the index must say what the files hold
                with open_safetensors(f) as h:
                    held = set(h.keys())
                for key in (k for k, v in files.items() if v == f and k not in held):
                    raise WeightsError(f"{index} maps tensor {key} to {f.name}, which does not hold it")
            return files
        if not os.path.lexists(p / SINGLE):
            raise WeightsError(f"{p} holds neither {SINGLE} nor {INDEX}")
        if not inside(p, p / SINGLE):
            raise WeightsError(f"{p / SINGLE} is a link that leads out of {p}")
        if not (p / SINGLE).is_file():
            raise WeightsError(f"{p / SINGLE} is not a regular file")
        p = p / SINGLE
    elif not p.is_file():
        raise WeightsError(f"--init-from {p}: no such file or directory")
    elif p.suffix != ".safetensors":
        raise WeightsError(f"{p} is not a .safetensors file, a model directory or a zerofunc checkpoint")
    with open_safetensors(p) as h:
        return {key: p for key in h.keys()}


def _copy_flat(out: torch.Tensor, rows: torch.Tensor, a: int, b: int) -> None:
    """out[:] = rows.reshape(-1)[a:b] for a 2-D `rows` that may be a transposed view, without making
    it contiguous: a part row, whole rows in one copy, a part row."""
    width = rows.shape[1]
    at = 0
    if a % width:
        n = min(width - a % width, b - a)
        out[:n].copy_(rows[a // width, a % width:a % width + n])
        a, at = a + n, n
    whole = (b - a) // width
    if whole:
        out[at:at + whole * width].view(whole, width).copy_(rows[a // width:a // width + whole])
        a, at = a + whole * width, at + whole * width
    if a < b:
        out[at:].copy_(rows[a // width, :b - a])


def read_range(handle, key: str, shape: tuple[int, ...], lo: int, hi: int, transposed: bool,
                out: torch.Tensor, memory) -> None:
    """Copy elements [lo, hi) of the (our-shaped) parameter stored as `key` into `out`."""
    sl = handle.get_slice(key)
    if len(shape) == 0:
        out.copy_(handle.get_tensor(key).reshape(-1))
        return
    width = math.prod(shape[1:])  # our row's length: a transposed weight's is the file's column count
    r0, r1 = lo // width, math.ceil(hi / width)
    # the rows holding [lo, hi): ours are the file's columns when transposed. safetensors hands out a
    # view of its memory map, so the slice costs page cache, not the process's own memory; it is
    # counted at its size anyway, as if read into a buffer, which is what the bound promises
    block = sl[:, r0:r1] if transposed else sl[r0:r1]
    held = memory.hold(block.numel() * block.element_size(), "other")
    if transposed:  # ours (out, in) is the file's (in, out) transposed
        _copy_flat(out, block.t(), lo - r0 * width, hi - r0 * width)
    else:
        out.copy_(block.reshape(-1)[lo - r0 * width:hi - r0 * width])
    memory.drop(held)
