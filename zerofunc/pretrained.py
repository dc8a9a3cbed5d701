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

from zerofunc import frozen_source
from zerofunc.checkpoint_files import CheckpointError, check_file, read_manifest, resolve, saved_spans
from zerofunc.hf_files import INDEX, SINGLE, WeightsError, open_safetensors, read_range, weight_files
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
        read_range(self._handle(self.files[key]), key, tuple(shape), lo, hi, self.names.transposed(name), out, memory)

    def locate(self, name: str) -> tuple[Path, str, bool]:
        """Where parameter `name` is stored: (file, tensor key, stored transposed); zerofunc/frozen_source.py."""
        key = self.names.key(name)
        return self.files[key], key, self.names.transposed(name)

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole parameter, in fp32 (for callers that take an init function)."""
        out = torch.empty(math.prod(shape), dtype=torch.float32)
        self.read_into(name, shape, 0, out.numel(), out, NoMemoryTracking())
        return out.view(shape)


class CheckpointWeights:
    """A zerofunc checkpoint's fp32 masters (and its frozen weights, saved or in the files it records), read range
    by range across its rank files."""

    def __init__(self, path: str | Path, checked: bool = False):
        """`checked`: the caller has checked every file against its checksum (an export, before it reads)."""
        self.checked = checked
        try:
            self.ckpt = resolve(path)
            self.manifest = read_manifest(self.ckpt)
        except CheckpointError as e:
            raise WeightsError(str(e)) from None
        # parameter: (unit index, offset in the unit's buffer, which buffer: "master" or a frozen part's "frozen")
        self.where: dict[str, tuple[int, int, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for i, unit in enumerate(self.manifest["units"]):
            parts = [("master", unit["params"])] + ([("frozen", unit["frozen"]["params"])] if "frozen" in unit else [])
            for kind, params in parts:
                for slot in FlatLayout.build(params, self.manifest["world_size"]).slots:
                    self.where[slot.name], self.shapes[slot.name] = (i, slot.offset, kind), slot.shape
        source = self.manifest.get("frozen_source")  # frozen weights kept in their first files, not here
        self._source = frozen_source.SourceReader(source, checked) if source is not None else None
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
        unit, offset, kind = self.where[name]
        if kind == "frozen" and self._source is not None:
            try:
                return self._source.read_into(name, shape, lo, hi, out, memory)
            except CheckpointError as e:
                raise WeightsError(str(e)) from None
        start, stop = offset + lo, offset + hi
        for f, a, b in saved_spans(self.manifest, unit, frozen=kind == "frozen"):
            lo_, hi_ = max(a, start), min(b, stop)
            if lo_ < hi_:
                if f not in self._handles:  # a file's checksum before its first read, of the files read only
                    self._handles[f] = self._checked_open(f)
                piece = self._handles[f].get_slice(f"{unit}.{kind}")[lo_ - a:hi_ - a]
                held = memory.hold(piece.numel() * piece.element_size(), "other")
                out[lo_ - start:hi_ - start].copy_(piece)
                memory.drop(held)

    def locate(self, name: str) -> Optional[tuple[Path, str, bool]]:
        """A frozen weight this checkpoint keeps in the files it records is stored there (zerofunc/frozen_source.py)."""
        if self._source is None or self.where[name][2] != "frozen":
            return None
        f, key, transposed = self._source.record["keys"][name]
        return Path(self._source.record["path"]) / f, key, transposed

    def _checked_open(self, f: str):
        """Rank file `f`, hashed whole first. Only the files a rank reads are hashed by it: every rank
        hashing every file read a 70B checkpoint once per rank (~54 TB on 64 ranks)."""
        if not self.checked:
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
