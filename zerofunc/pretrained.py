"""Pretrained weights in: each rank reads only the elements of its own shard, straight from the files.

    engine = zerofunc.initialize(meta_model, config, init=pretrained.weights(path, meta_model))

`path` is a Hugging Face model directory (`model.safetensors`, or the sharded
`model-0000K-of-0000N.safetensors` with `model.safetensors.index.json`), a single
`.safetensors` file, or a zerofunc checkpoint (a checkpoint directory, or a run directory:
its newest one; the fp32 masters, without the optimizer's state).

The engine fills each flat buffer piece by piece (zerofunc/units.py `materialize`); a
source here offers `read_into(name, shape, lo, hi, out, memory)`, which copies elements
[lo, hi) of the flattened parameter into `out`. It reads them with safetensors' lazy
slices from the memory-mapped file: the rows that hold the range (a flat range of a 2-D
tensor needs whole rows, then a cut), or, for a weight stored transposed (GPT-2's Conv1D),
the columns. So a rank never holds more than its shard plus one such slice, no rank builds
the whole model, and the files are never copied: what lets a 70B fine-tune load on hosts
that cannot hold 70B parameters per rank. Dtypes convert in the copy (a bf16 file into the
fp32 master and the 16-bit working copy).

`check(model)` compares the files' names and shapes with the model's parameters, reading
headers only; every mismatch is a `WeightsError` whose one line names the tensor and the file.
Which file holds each tensor, and opening it without reading outside the model directory, is
zerofunc/hf_files.py.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from zerofunc.checkpoint_files import CheckpointError, check_file, read_manifest, resolve, saved_spans
from zerofunc.hf_files import INDEX, SINGLE, WeightsError, open_safetensors, weight_files
from zerofunc.hf_names import HFNames, hf_names
from zerofunc.layout import FlatLayout
from sim.memory import NoMemoryTracking


@contextlib.contextmanager
def parameters_on_meta():
    """Build a model inside this to have its parameters on the meta device (no memory, filled later by
    `weights`) and its buffers real: a rotary embedding computes its inv_freq in __init__ and no
    file holds it. Accelerate's init_empty_weights(include_buffers=False) works the same way: each
    parameter is made where torch makes it and moved to meta at once, so one exists at a time."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def is_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / "manifest.json").is_file() or (p / "checkpoints" / "latest").is_file()


def weights(path: str | Path, model: nn.Module) -> "SafetensorsWeights | CheckpointWeights":
    """The weights at `path` for `model` (on the meta device is enough), checked against its parameters."""
    source = CheckpointWeights(path) if is_checkpoint(path) else SafetensorsWeights(path, model)
    source.check(model)
    return source


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


def _read_range(handle, key: str, shape: tuple[int, ...], lo: int, hi: int, transposed: bool,
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


class SafetensorsWeights:
    """A Hugging Face model's weights in safetensors files, read range by range."""

    def __init__(self, path: str | Path, model: nn.Module):
        self.files = weight_files(path)
        p = Path(path)
        self.where = p / INDEX if (p / INDEX).is_file() else p / SINGLE if p.is_dir() else p
        self.names: HFNames = hf_names(model, self.files)
        self._handles: dict[Path, object] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def _handle(self, f: Path):
        if f not in self._handles:
            self._handles[f] = open_safetensors(f)
        return self._handles[f]

    def check(self, model: nn.Module) -> None:
        """Every parameter present with its shape, and no file tensor left over; headers only."""
        wanted = {}
        for name, p in model.named_parameters():
            key = self.names.key(name)
            shape = tuple(p.shape)[::-1] if self.names.transposed(name) else tuple(p.shape)
            if key not in self.files:
                of = "" if key == name else f" (the model's {name})"
                raise WeightsError(f"missing tensor {key}{of}: {self.where} holds no such tensor")
            wanted[key] = shape
        for key, f in self.files.items():
            if key not in wanted:
                if not self.names.skipped(key):
                    raise WeightsError(f"unexpected tensor {key} in {f}: the model has no such parameter")
                continue
            try:
                stored = tuple(self._handle(f).get_slice(key).get_shape())
            except WeightsError:
                raise
            except Exception as e:
                raise WeightsError(f"cannot read tensor {key} in {f}: {type(e).__name__}: {e}") from None
            if stored != wanted[key]:
                raise WeightsError(f"tensor {key} in {f} has shape {list(stored)}, the model's is {list(wanted[key])}")

    def read_into(self, name: str, shape: tuple[int, ...], lo: int, hi: int, out: torch.Tensor, memory) -> None:
        key = self.names.key(name)
        _read_range(self._handle(self.files[key]), key, tuple(shape), lo, hi, self.names.transposed(name), out, memory)

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole parameter, in fp32 (for callers that take an init function)."""
        out = torch.empty(math.prod(shape), dtype=torch.float32)
        self.read_into(name, shape, 0, out.numel(), out, NoMemoryTracking())
        return out.view(shape)


class CheckpointWeights:
    """A zerofunc checkpoint's fp32 masters, read range by range across its rank files."""

    def __init__(self, path: str | Path):
        try:
            self.ckpt = resolve(path)
            self.manifest = read_manifest(self.ckpt)
        except CheckpointError as e:
            raise WeightsError(str(e)) from None
        self.where: dict[str, tuple[int, int]] = {}  # parameter: (unit index, offset in the unit's buffer)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for i, unit in enumerate(self.manifest["units"]):
            for slot in FlatLayout.build(unit["params"], self.manifest["world_size"]).slots:
                self.where[slot.name], self.shapes[slot.name] = (i, slot.offset), slot.shape
        self._handles: dict[str, object] = {}

    def check(self, model: nn.Module) -> None:
        mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
        for name, shape in mine.items():
            if name not in self.shapes:
                raise WeightsError(f"missing tensor {name} in checkpoint {self.ckpt}")
            if self.shapes[name] != shape:
                raise WeightsError(f"tensor {name} in checkpoint {self.ckpt} has shape {list(self.shapes[name])}, "
                                   f"the model's is {list(shape)}")
        for name in self.shapes.keys() - mine.keys():
            raise WeightsError(f"unexpected tensor {name} in checkpoint {self.ckpt}: the model has no such parameter")

    def read_into(self, name: str, shape: tuple[int, ...], lo: int, hi: int, out: torch.Tensor, memory) -> None:
        unit, offset = self.where[name]
        start, stop = offset + lo, offset + hi
        for f, a, b in saved_spans(self.manifest, unit):
            lo_, hi_ = max(a, start), min(b, stop)
            if lo_ < hi_:
                if f not in self._handles:  # a file's checksum before its first read, of the files read only
                    self._handles[f] = self._checked_open(f)
                piece = self._handles[f].get_slice(f"{unit}.master")[lo_ - a:hi_ - a]
                held = memory.hold(piece.numel() * piece.element_size(), "other")
                out[lo_ - start:hi_ - start].copy_(piece)
                memory.drop(held)

    def _checked_open(self, f: str):
        """Rank file `f`, hashed whole first. Only the files a rank reads are hashed by it: every rank
        hashing every file read a 70B checkpoint once per rank (~54 TB on 64 ranks)."""
        try:
            check_file(self.ckpt, self.manifest, f)
        except CheckpointError as e:
            raise WeightsError(str(e)) from None
        return open_safetensors(self.ckpt / f)

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(math.prod(shape), dtype=torch.float32)
        self.read_into(name, shape, 0, out.numel(), out, NoMemoryTracking())
        return out.view(shape)


def model_spec(path: str | Path) -> Optional[str]:
    """The model an `--init-from` path implies: a model directory's config.json, or the model a
    zerofunc checkpoint was saved from; None for a lone .safetensors file."""
    p = Path(path)
    if not p.exists():
        raise WeightsError(f"--init-from {p}: no such file or directory")
    if is_checkpoint(p):
        try:
            return read_manifest(resolve(p)).get("extra", {}).get("model")
        except CheckpointError as e:
            raise WeightsError(str(e)) from None
    if p.is_dir() and (p / "config.json").is_file():
        return str(p / "config.json")
    return None
