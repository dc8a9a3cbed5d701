"""A checkpoint on disk: its layout, its manifest, its checksums, and reading it without an engine.

    checkpoints/step-00000100/manifest.json       what was saved, by whom, at which step
    checkpoints/step-00000100/rank-00000.safetensors   per unit: fp32 master, m, v of the rank's span
    checkpoints/latest                            the name of the newest complete checkpoint

The manifest holds each shard file's SHA-256, and every reader checks it, whole file,
before it reads a tensor from that file: `zerofunc.checkpoint.load` (each rank the files
it reads), `consolidated` and `verify`. A flipped byte in a file is a `CheckpointError`
that names it, never silently different weights. Saving and loading into an engine are
zerofunc/checkpoint.py.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from sim.memory import NoMemoryTracking
from zerofunc.layout import FlatLayout

FORMAT = "zerofunc-checkpoint-1"


class CheckpointError(ValueError):
    bad_input = True  # found in a rank too (a checksum, a frozen weights' file), it is still the user's: one line, exit 2


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def sha256(path: Path) -> str:
    """The file's SHA-256, read through one reused 1 MiB buffer: a fresh 16 MiB bytes object per
    block (f.read) made hashing a 747 MB shard ~1.6x slower (measured on 2 CPU cores)."""
    digest, buf = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def step_dir(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of training step `step` lives under a run directory."""
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def resolve(path: str | Path) -> Path:
    """A checkpoint directory: the path itself, or the newest one under a run directory."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    latest = p / "checkpoints" / "latest"
    if latest.is_file():
        target = p / "checkpoints" / latest.read_text().strip()
        if (target / "manifest.json").is_file():
            return target
        raise CheckpointError(f"{latest} names {target.name}, which is not a complete checkpoint")
    raise CheckpointError(f"no checkpoint at {p}: neither a checkpoint directory nor a run directory with one")


def read_manifest(ckpt: Path) -> dict:
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has an unreadable manifest: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {ckpt} is not a {FORMAT} checkpoint")
    missing = [f for f in manifest["files"] if not (ckpt / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} is missing {', '.join(missing)}")
    return manifest


def check_file(ckpt: Path, manifest: dict, f: str) -> None:
    """Shard file `f` against the checksum the save recorded, before anything reads a tensor from it.

    The whole file is hashed even where the reader then takes a slice of it: the checksum is
    of the file. That pass brings the file into the page cache, so the slices read after it
    cost a copy from memory, not a second read from disk. Checkpoints from before checksums
    (no "sha256" in the manifest) have none to check.
    """
    if "sha256" not in manifest:
        return
    expected = manifest["sha256"].get(f)
    if expected is None:
        raise CheckpointError(f"checkpoint {ckpt}: the manifest records no checksum for {f}")
    if sha256(ckpt / f) != expected:
        raise CheckpointError(f"checkpoint {ckpt}: {f} does not match the checksum saved with it "
                              f"(the file changed after the save)")


def check_files(ckpt: Path, manifest: dict, files: Optional[list[str]] = None) -> None:
    """`files` (by default every shard file of the checkpoint) against their checksums, in order."""
    for f in manifest["files"] if files is None else files:
        check_file(ckpt, manifest, f)


def unit_params(layout: FlatLayout, frozen: Optional[FlatLayout] = None) -> tuple[list, list]:
    """A unit's parameters as a manifest lists them: [name, shape] pairs, trainable and frozen."""
    return ([[s.name, list(s.shape)] for s in layout.slots],
            [[s.name, list(s.shape)] for s in frozen.slots] if frozen is not None else [])


def verify(path: str | Path, units: list[tuple[list, list]]) -> dict:
    """Check a checkpoint before any rank starts: its manifest, every shard's header, and that
    its parameters are `units` (per unit, `unit_params`' pair). Returns the manifest."""
    ckpt = resolve(path)
    manifest = read_manifest(ckpt)
    check_model(ckpt, manifest, units)
    saved_frozen = manifest.get("frozen_source") is None
    for i, unit in enumerate(manifest["units"]):
        parts = [("master", "m", "v")] + ([("frozen",)] if "frozen" in unit and saved_frozen else [])
        for kinds in parts:
            for f, lo, hi in saved_spans(manifest, i, frozen=kinds == ("frozen",)):
                try:
                    with safe_open(str(ckpt / f), framework="pt") as h:
                        sizes = {h.get_slice(f"{i}.{kind}").get_shape()[0] for kind in kinds}
                except Exception as e:
                    raise CheckpointError(f"checkpoint {ckpt}: {f} is corrupt ({type(e).__name__}: {e})") from None
                if sizes != {hi - lo}:
                    raise CheckpointError(f"checkpoint {ckpt}: {f} holds {sorted(sizes)} elements of unit {i}, "
                                          f"expected {hi - lo}")
    check_files(ckpt, manifest)  # whole files, after the headers have said what is wrong in the usual case
    if not saved_frozen:
        from zerofunc import frozen_source
        frozen_source.check_present(manifest["frozen_source"])
    return manifest


def check_model(ckpt: Path, manifest: dict, units: list[tuple[list, list]]) -> None:
    """The checkpoint's parameters are `units` (per unit, `unit_params`' trainable and frozen lists)."""
    saved = [(u["params"], u.get("frozen", {}).get("params", [])) for u in manifest["units"]]
    if [sorted(a + b) for a, b in saved] != [sorted(a + b) for a, b in units]:
        raise CheckpointError(f"checkpoint {ckpt} holds a different model (its parameters do not match)")
    if saved != [tuple(u) for u in units]:
        raise CheckpointError(f"checkpoint {ckpt} was saved with other parameters frozen (requires_grad=False): "
                              "freeze the same ones (the same --lora) to resume it")


def saved_spans(manifest: dict, unit_index: int, frozen: bool = False) -> list[tuple[str, int, int]]:
    """(file, start, stop) of each saved shard of a unit, in its padded flat buffer (`frozen`: its frozen one)."""
    unit = manifest["units"][unit_index]
    padded = unit["frozen"]["padded_numel"] if frozen else unit["padded_numel"]
    if len(manifest["files"]) == 1:
        return [(manifest["files"][0], 0, padded)]
    size = padded // manifest["world_size"]
    return [(f, r * size, (r + 1) * size) for r, f in enumerate(manifest["files"])]


def consolidated(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter, whole, in fp32, from a checkpoint's masters (no process group needed); a frozen one
    from its saved values or from the files its manifest records (zerofunc/frozen_source.py)."""
    from zerofunc import frozen_source  # which reads through this module's checksums
    ckpt = resolve(path)
    manifest = read_manifest(ckpt)
    check_files(ckpt, manifest)  # every file, before any tensor is read
    source = manifest.get("frozen_source")
    if source is not None:  # every file, before any tensor is read
        frozen_source.check_share(source, 0, 1)
    reader = frozen_source.SourceReader(source, checked=True) if source is not None else None
    out = {}
    try:
        handles = {f: safe_open(str(ckpt / f), framework="pt") for f in manifest["files"]}
        for i, unit in enumerate(manifest["units"]):
            flat = torch.cat([handles[f].get_tensor(f"{i}.master") for f, _, _ in saved_spans(manifest, i)])
            # the parameters sit at the same offsets whatever padding follows them (checkpoints from before
            # shards were padded to 16 elements have less)
            layout = FlatLayout.build(unit["params"], manifest["world_size"])
            out.update({s.name: flat[s.offset:s.offset + s.numel].view(s.shape).clone() for s in layout.slots})
            if "frozen" not in unit:
                continue
            layout = FlatLayout.build(unit["frozen"]["params"], manifest["world_size"])
            if reader is not None:
                for s in layout.slots:
                    out[s.name] = torch.empty(s.numel)
                    reader.read_into(s.name, s.shape, 0, s.numel, out[s.name], NoMemoryTracking())
                    out[s.name] = out[s.name].view(s.shape)
            else:
                flat = torch.cat([handles[f].get_tensor(f"{i}.frozen") for f, _, _ in saved_spans(manifest, i, True)])
                out.update({s.name: flat[s.offset:s.offset + s.numel].view(s.shape).float() for s in layout.slots})
    except Exception as e:  # a truncated file of a checkpoint from before checksums
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {type(e).__name__}: {e}") from None
    return out
