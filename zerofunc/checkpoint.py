"""Sharded checkpoints: each rank saves what its optimizer owns; any world size or stage loads them.

What is on disk, and reading it without an engine (checksums, `verify`, `consolidated`),
is zerofunc/checkpoint_files.py. A save writes into a temporary directory, renames it
into place, and only then replaces `latest` (both renames are atomic), so a run killed
mid-save still resumes from the previous checkpoint. `load` checks the SHA-256 of every file a rank reads before
it reads from it.

Resharding works because a unit's parameters sit in the same order at every world
size and stage; only the padding and the shard boundaries move. A loading rank reads,
from each saved shard, just the elements of the span it now owns.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from sim.memory import NoMemoryTracking
from zerofunc import frozen_source
from zerofunc.checkpoint_files import (FORMAT, CheckpointError, check_files, check_model, rank_file, read_manifest,
                                       resolve, saved_spans, sha256, step_dir, unit_params)
from zerofunc.engine import ZeroEngine
from zerofunc.state import OptimizerState


def _owned_span(engine: ZeroEngine, layout) -> tuple[int, int]:
    """The [start, stop) of a unit's padded flat buffer (`layout`'s) that this rank's optimizer owns: what its file
    holds."""
    return layout.shard_range(engine.comm.rank) if engine.stage.shard_optimizer else (0, layout.padded_numel)


def _frozen_span(engine: ZeroEngine, unit) -> tuple[int, int]:
    """The [start, stop) of the unit's padded frozen buffer that this rank keeps (stage 3: its shard)."""
    return unit.frozen.layout.shard_range(engine.comm.rank) if engine.stage.shard_params else \
        (0, unit.frozen.layout.padded_numel)


def _frozen_saved(engine: ZeroEngine, unit) -> torch.Tensor:
    """The elements of the unit's frozen buffer this rank's file holds: those of the span its optimizer would own."""
    start, stop = _owned_span(engine, unit.frozen.layout)
    kept, _ = _frozen_span(engine, unit)
    return unit.frozen.params[start - kept:stop - kept]


def _unit_entry(unit) -> dict:
    params, frozen = unit_params(unit.layout, unit.frozen and unit.frozen.layout)
    entry = {"name": unit.name, "numel": unit.layout.numel, "padded_numel": unit.layout.padded_numel, "params": params}
    if unit.frozen is not None:  # a frozen part (zerofunc/units.py), in the compute dtype
        f = unit.frozen
        entry["frozen"] = {"numel": f.layout.numel, "padded_numel": f.layout.padded_numel,
                           "dtype": str(f.params.dtype).removeprefix("torch."), "params": frozen}
    return entry


def save(engine: ZeroEngine, run_dir: str | Path, step: int, extra: Optional[dict] = None,
         state: Optional[OptimizerState] = None) -> Path:
    """Save the engine's buffers and `state` (by default the engine's own, `engine.state`) as of training
    step `step`; collective over all ranks.

    A rank that cannot write (disk full, read-only, a quota) makes every rank raise the
    same `SaveError` after the partial directory is removed: the previous checkpoint and
    `latest` are untouched, and no rank is left waiting in a collective.
    """
    final = step_dir(run_dir, step)
    root, name = final.parent, final.name
    tmp = root / f".{name}.partial"
    rank, world = _data_parallel_rank(engine), engine.data_parallel_size  # who agrees, and who publishes
    shard, shards = engine.comm.rank, engine.comm.world_size  # which file: under hybrid sharding, the
    # first shard group's ranks (0 .. S-1, shard rank = rank) write; every replica holds the same shards
    finite = all(bool(torch.isfinite(u.master).all()) for u in engine.units)
    failure = None
    if rank == 0:
        _, failure = _attempt(lambda: (shutil.rmtree(tmp, ignore_errors=True), tmp.mkdir(parents=True)))
    # The optimizer never applies a non-finite step; refusing here makes sure no NaN is ever kept.
    states = _agree(world, (finite, failure))
    if not all(ok for ok, _ in states):
        _discard(rank, tmp)
        bad = next(r for r, (ok, _) in enumerate(states) if not ok)
        raise CheckpointError(f"refusing to save step {step}: the weights of rank {bad} hold an inf or a NaN")
    _raise_failure(rank, tmp, step, final, [f for _, f in states])

    # frozen weights read from files are recorded by those files' SHA-256, not saved (zerofunc/frozen_source.py)
    source = engine.frozen_source
    if source is not None and "sha256" not in source:
        share, failure = _attempt(lambda: frozen_source.hash_share(source, rank, world))
        states = _agree(world, (share, failure))
        _raise_failure(rank, tmp, step, final, [f for _, f in states])
        hashes = {f: d for share, _ in states for f, d in share.items()}
        source = {**source, "sha256": hashes,
                  "bytes": {f: (Path(source["path"]) / f).stat().st_size for f in hashes}}

    digest, failure = None, None
    if (engine.stage.shard_optimizer and rank < shards) or rank == 0:  # stage 0: every rank holds the same
        def write():
            tensors = {}
            for i, unit in enumerate(engine.units):
                for kind in ("master", "m", "v"):
                    tensors[f"{i}.{kind}"] = getattr(unit, kind).detach().cpu().contiguous()
                if unit.frozen is not None and source is None:
                    tensors[f"{i}.frozen"] = _frozen_saved(engine, unit).detach().cpu().contiguous()
            save_file(tensors, str(tmp / rank_file(shard)))
            return sha256(tmp / rank_file(shard))  # each rank hashes its own file, in parallel
        digest, failure = _attempt(write)
    states = _agree(world, (digest, failure))
    _raise_failure(rank, tmp, step, final, [f for _, f in states])

    failure = None
    if rank == 0:
        state = state if state is not None else engine.state
        manifest = {
            "format": FORMAT, "step": step, "optimizer_steps": state.steps, "world_size": shards,
            "stage": engine.stage.level,
            "files": [rank_file(r) for r in (range(shards) if engine.stage.shard_optimizer else [0])],
            "sha256": {rank_file(r): d for r, (d, _) in enumerate(states) if d is not None},
            "units": [_unit_entry(u) for u in engine.units], "frozen_source": source,
            "loss_scaler": state.loss_scale.state_dict() if state.loss_scale else None,
            "skipped_steps": state.skipped, "nonfinite_steps": state.nonfinite, "extra": extra or {},
        }

        def publish():
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            latest_tmp = root / ".latest.partial"
            latest_tmp.write_text(name)
            os.replace(latest_tmp, root / "latest")
        _, failure = _attempt(publish)
    _raise_failure(rank, tmp, step, final, _agree(world, failure))
    return final


class SaveError(CheckpointError):
    """A checkpoint could not be written; the previous one and `latest` are intact."""


def _attempt(action):
    """Run one part of a save: (its result, None), or (None, what went wrong in one line)."""
    try:
        return action(), None
    except Exception as e:  # OSError, and safetensors' own error for a failed write
        text = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [repr(e)])[0]
        return None, f"{text} ({e.filename})" if isinstance(e, OSError) and e.filename else text


def _agree(world: int, mine):
    """Every rank's `mine`, on every rank: each part of a save or a load ends in this one collective."""
    if world == 1:
        return [mine]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def _discard(rank: int, tmp: Path) -> None:
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_failure(rank: int, tmp: Path, step: int, final: Path, failures: list) -> None:
    bad = [r for r, f in enumerate(failures) if f]
    if bad:
        _discard(rank, tmp)
        raise SaveError(f"could not save the checkpoint of step {step} to {final}: rank {bad[0]}: "
                        f"{failures[bad[0]]}")


def _data_parallel_rank(engine: ZeroEngine) -> int:
    """This rank among all data-parallel ranks: its shard rank, unless hybrid sharding makes groups."""
    return dist.get_rank() if engine.replicas is not None else engine.comm.rank


def load(engine: ZeroEngine, path: str | Path) -> dict:
    """Load a checkpoint saved at any world size or stage into `engine` (its buffers, and its state,
    `engine.state`); returns the manifest.

    Collective over all ranks. Each rank checks the SHA-256 of every shard file it reads, whole,
    before it reads from it, and the ranks agree on the outcome: a file that fails its checksum
    on one rank makes every rank raise the same `CheckpointError` naming it, before any rank has
    changed its engine (no rank goes on alone, to wait in a collective the others never reach).
    """
    ckpt = resolve(path)
    manifest = read_manifest(ckpt)
    check_model(ckpt, manifest, [unit_params(u.layout, u.frozen and u.frozen.layout) for u in engine.units])
    world = engine.data_parallel_size  # the ranks that agree; each reads by its shard rank
    reads = []  # per unit: (unit, where its span starts here, [(file, file's start, a, b)] to copy [a, b) from)
    for i, unit in enumerate(engine.units):
        start, stop = _owned_span(engine, unit.layout)
        pieces = [(f, lo, max(lo, start), min(hi, stop, unit.layout.numel)) for f, lo, hi in saved_spans(manifest, i)]
        reads.append((unit, start, [p for p in pieces if p[2] < p[3]]))
    source = manifest.get("frozen_source")
    frozen_reads = []  # per unit with frozen parameters: as `reads`, of its frozen buffer; none read from a source
    for i, unit in enumerate(engine.units):
        if unit.frozen is not None and source is None:
            start, stop = _frozen_span(engine, unit)
            pieces = [(f, lo, max(lo, start), min(hi, stop, unit.frozen.layout.numel))
                      for f, lo, hi in saved_spans(manifest, i, frozen=True)]
            frozen_reads.append((unit, start, [p for p in pieces if p[2] < p[3]], i))
    files = sorted({f for _, _, pieces, *_ in reads + frozen_reads for f, *_ in pieces})

    def copy():
        handles = {f: safe_open(str(ckpt / f), framework="pt") for f in files}
        for i, (unit, start, pieces) in enumerate(reads):
            for kind in ("master", "m", "v"):
                target = getattr(unit, kind)
                with torch.no_grad():
                    target.zero_()  # padding stays zero
                    for f, lo, a, b in pieces:
                        target[a - start:b - start].copy_(handles[f].get_slice(f"{i}.{kind}")[a - lo:b - lo])
        for unit, start, pieces, i in frozen_reads:
            with torch.no_grad():
                for f, lo, a, b in pieces:
                    unit.frozen.params[a - start:b - start].copy_(handles[f].get_slice(f"{i}.frozen")[a - lo:b - lo])
        if source is not None:  # the frozen weights from the files they were first read from, checked below
            reader = frozen_source.SourceReader(source, checked=True)
            for unit in engine.units:
                if unit.frozen is not None:
                    start, stop = _frozen_span(engine, unit)
                    with torch.no_grad():
                        for slot, lo, hi, at in unit.frozen.layout.pieces(start, stop):
                            reader.read_into(slot.name, slot.shape, lo, hi, unit.frozen.params[at:at + hi - lo],
                                             NoMemoryTracking())

    def check():
        check_files(ckpt, manifest, files)
        if source is not None:  # each rank hashes its share of the frozen weights' files
            frozen_source.check_share(source, _data_parallel_rank(engine), world)

    _load_step(ckpt, world, check)
    _load_step(ckpt, world, copy)  # a truncated file of a checkpoint from before checksums fails here
    scale = engine.state.loss_scale
    if scale is not None and manifest.get("loss_scaler"):
        scale = replace(scale, **manifest["loss_scaler"])
    # nonfinite_steps is absent from checkpoints saved before it was
    engine.state = OptimizerState(manifest["optimizer_steps"], manifest.get("skipped_steps", 0),
                                  manifest.get("nonfinite_steps", 0), loss_scale=scale)
    engine.optimizer.refresh_params()
    engine.frozen_source = source  # the next save records the same files again
    return manifest


def _load_step(ckpt: Path, world: int, action) -> None:
    """Run one part of a load on every rank; if it failed on any rank, raise the first rank's error on all."""
    try:
        action()
        failure = None
    except CheckpointError as e:
        failure = str(e)
    except Exception as e:  # a truncated or corrupt shard file
        failure = f"checkpoint {ckpt} is corrupt: {type(e).__name__}: {e}"
    failures = [f for f in _agree(world, failure) if f]
    if failures:
        raise CheckpointError(failures[0])
