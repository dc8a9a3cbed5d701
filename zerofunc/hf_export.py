"""A zerofunc checkpoint as a Hugging Face model directory, streamed tensor by tensor.

    OUT_DIR/config.json                        the model's config.json, with `architectures` and the dtype
    OUT_DIR/model.safetensors                  when everything fits in one file of --max-shard-size, else
    OUT_DIR/model-00001-of-0000N.safetensors   the shards, and
    OUT_DIR/model.safetensors.index.json       {"metadata": {"total_size"}, "weight_map": {tensor: file}}
    OUT_DIR/tokenizer.json ...                 when --tokenizer is given

Why streamed: a 70B checkpoint must consolidate on a host that cannot hold it twice. Each
parameter is read from the rank files with safetensors' lazy slices (an mmap: only the
elements asked for are touched), at most CHUNK elements at a time, converted as it is copied
into its output tensor, and that tensor joins the output shard being built; a shard is written
and freed before the next begins. In memory at any time: one output shard, plus one tensor
and one chunk in flight. Shard boundaries are planned from the manifest's shapes before any
byte is read, so the file names (`-of-0000N`) are known from the start.

Names, GPT-2's transposed Conv1D weights and the tied head that is left out are
zerofunc/hf_names.py's, the same map the loader reads with. Nothing appears under OUT_DIR
until everything is written: the directory is built beside it and renamed into place (zerofunc/export_dir.py).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from zerofunc.checkpoint_files import CheckpointError, check_files, read_manifest, resolve, saved_spans
from zerofunc.export_dir import ExportError, check_target, staged
from zerofunc.frozen_source import check_share
from zerofunc.hf_names import architecture, hf_names
from zerofunc.layout import FlatLayout
from zerofunc.lora import is_adapter
from zerofunc.models import MODELS, build_model, hf_config_dict, model_config
from zerofunc.pretrained import CheckpointWeights

CHUNK = 1 << 24  # elements read per slice: 64 MiB of fp32 in flight beside the output tensor
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the export: where the parameter sits in the checkpoint, and how it is stored."""

    key: str                 # its name in the Hugging Face files
    unit: int                # the checkpoint unit whose flat buffer holds it
    offset: int              # its first element in that buffer
    shape: tuple[int, ...]   # the parameter's shape, ours
    transposed: bool         # stored (in, out): GPT-2's Conv1D
    name: str = ""           # ours
    part: str = "master"     # the buffer: the fp32 masters, or a frozen part's ("frozen")
    merge: Optional[tuple["OutTensor", "OutTensor", float]] = None  # LoRA's A, B and scaling, merged into it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transposed else self.shape


def model_spec_file(spec: str) -> Optional[Path]:
    """The config.json a spec names (a model directory's, or the file itself); None for a preset name.
    A path wins over a preset of the same name, except a directory without config.json."""
    path = Path(spec)
    if spec and path.is_dir():  # Path("") is the working directory
        if (path / "config.json").is_file():
            return path / "config.json"
        if spec in MODELS:
            return None
        raise ExportError(f"model directory {path} has no config.json")
    return path if spec.endswith(".json") or path.is_file() else None


def build_meta_model(spec: str) -> nn.Module:
    """The model a spec names, on the meta device: its parameter names and shapes, no weights."""
    config_file = model_spec_file(spec)
    try:
        cfg = model_config(str(config_file) if config_file else spec)
        with torch.device("meta"):
            return build_model(cfg)
    except (ValueError, TypeError) as e:
        raise ExportError(f"cannot build model {spec}: {e}") from None


def plan_tensors(ckpt: Path, manifest: dict, model: nn.Module, spec: str) -> list[OutTensor]:
    """The export's tensors, in the model's parameter order (Hugging Face's order: embedding first, head
    last), after checking that the checkpoint holds exactly the model's parameters: the base model's, frozen or
    not, and, when the trainer recorded its LoRA, the adapters it merges into their weights."""
    where, saved = {}, {}
    for i, unit in enumerate(manifest["units"]):
        parts = [("master", unit["params"])] + ([("frozen", unit["frozen"]["params"])] if "frozen" in unit else [])
        for part, params in parts:
            for slot in FlatLayout.build(params, manifest["world_size"]).slots:
                where[slot.name], saved[slot.name] = (i, slot.offset, part), slot.shape
    lora = manifest.get("extra", {}).get("lora")
    adapters = {n for n in saved if is_adapter(n)} if lora else set()
    ours = {name: tuple(p.shape) for name, p in model.named_parameters()}
    base = {n: shape for n, shape in saved.items() if n not in adapters}
    if base != ours:
        missing, unexpected = sorted(ours.keys() - base.keys()), sorted(base.keys() - ours.keys())
        reshaped = [f"{n} {list(base[n])} (model: {list(ours[n])})" for n in ours.keys() & base.keys()
                    if base[n] != ours[n]]
        parts = [f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" for what, names in
                 (("not in the checkpoint", missing), ("not in the model", unexpected),
                  ("shapes differ", sorted(reshaped))) if names]
        raise ExportError(f"checkpoint {ckpt} does not hold model {spec} ({'; '.join(parts)})")
    names = hf_names(model)

    def planned(name: str, key: str = "", transposed: bool = False) -> OutTensor:
        unit, offset, part = where[name]
        return OutTensor(key, unit, offset, saved[name], transposed, name, part)

    out = []
    for name, shape in ours.items():
        if names.skipped(names.key(name)):
            continue
        t = planned(name, names.key(name), names.transposed(name))
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapters:  # W + (alpha / r) B A, in fp32
            a, b = planned(f"{module}.lora_A.weight"), planned(f"{module}.lora_B.weight")
            t = replace(t, merge=(a, b, lora["alpha"] / lora["r"]))
        out.append(t)
    return out


def plan_shards(tensors: list[OutTensor], dtype: torch.dtype, max_bytes: int) -> list[list[OutTensor]]:
    """Hugging Face's split: a new shard when the next tensor would take this one past max_bytes;
    a tensor larger than max_bytes gets a shard of its own."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel * dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def shard_file_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


def read_tensor(handles: dict, manifest: dict, t: OutTensor, dtype: torch.dtype,
                whole: Optional[CheckpointWeights] = None) -> torch.Tensor:
    """Parameter `t`, whole, in `dtype` and stored layout, from the rank files it spans: a master's chunk by chunk,
    a frozen one's or one with adapters to merge whole, in fp32, through `whole` (zerofunc/pretrained.py)."""
    if t.part == "frozen" or t.merge is not None:
        value = whole(t.name, t.shape)
        if t.merge is not None:
            a, b, scaling = t.merge
            value += scaling * (whole(b.name, b.shape) @ whole(a.name, a.shape))
        value = value.to(dtype)
        return value.t().contiguous() if t.transposed else value
    out = torch.empty(t.stored_shape, dtype=dtype)
    rows = out.t() if t.transposed else out.view(1, -1)  # our (out, in) layout, written through
    start, stop = t.offset, t.offset + t.numel
    for f, lo, hi in saved_spans(manifest, t.unit):
        master = handles[f].get_slice(f"{t.unit}.master")
        for a in range(max(lo, start), min(hi, stop), CHUNK):
            b = min(a + CHUNK, hi, stop)
            _copy_flat_range(rows, a - start, master[a - lo:b - lo])
    return out


def _copy_flat_range(rows: torch.Tensor, at: int, values: torch.Tensor) -> None:
    """Write `values` over elements [at, at + n) of `rows` (2-D, maybe a transposed view) in row-major
    order: a partial first row, whole rows in one copy, a partial last row. copy_ converts the dtype."""
    width, n, i = rows.shape[1], values.numel(), 0
    row, col = divmod(at, width)
    if col:
        i = min(width - col, n)
        rows[row, col:col + i].copy_(values[:i])
        row += 1
    whole = (n - i) // width
    if whole:
        rows[row:row + whole].copy_(values[i:i + whole * width].view(whole, width))
        i, row = i + whole * width, row + whole
    if i < n:
        rows[row, :n - i].copy_(values[i:])


def export_config(spec: str, model: nn.Module, dtype: torch.dtype) -> dict:
    """The user's own config.json when the spec names one (their token ids, rope settings and the like
    survive), else the preset's; with `architectures` and the export dtype (`torch_dtype` for
    transformers 4, `dtype` as transformers 5 writes it)."""
    config_file = model_spec_file(spec)
    if config_file is not None:
        try:
            doc = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise ExportError(f"cannot read {config_file}: {e}") from None
    else:
        doc = hf_config_dict(model.cfg)
    dtype_name = str(dtype).removeprefix("torch.")
    return {**doc, "architectures": [architecture(model)], "torch_dtype": dtype_name, "dtype": dtype_name}


def tokenizer_files(path: str) -> list[tuple[Path, str]]:
    """(source, name in OUT_DIR) for a tokenizer.json file or a directory holding one, and the
    tokenizer files found beside it."""
    p = Path(path)
    main = p / "tokenizer.json" if p.is_dir() else p
    if not main.is_file():
        raise ExportError(f"no tokenizer at {path}: give a tokenizer.json file or a directory holding one")
    beside = [(main.parent / name, name) for name in TOKENIZER_FILES[1:] if (main.parent / name).is_file()]
    return [(main, "tokenizer.json"), *beside]


def export(checkpoint: str, out_dir: str, *, dtype: torch.dtype = torch.float32, max_shard_size: int = 5 * 10**9,
           tokenizer: Optional[str] = None, model_spec: Optional[str] = None) -> dict:
    """Write checkpoint `checkpoint` (a checkpoint or run directory) as a Hugging Face model directory.

    Every input is checked before anything is hashed or read: the checkpoint's manifest, the model
    (--model, else the spec the trainer saved) against its parameters, the tokenizer, OUT_DIR. Then
    the shard files' checksums, then the writing. Returns what was written."""
    ckpt = resolve(checkpoint)
    manifest = read_manifest(ckpt)
    spec = model_spec or manifest.get("extra", {}).get("model")
    if not spec:
        raise ExportError(f"checkpoint {ckpt} does not record its model: pass --model")
    try:
        model = build_meta_model(spec)
    except ExportError as e:
        raise ExportError(f"{e}{'' if model_spec else ' (the spec the checkpoint records; pass --model)'}") from None
    if architecture(model) is None:
        raise ExportError(f"model {spec} has no Hugging Face architecture to export to")
    tensors = plan_tensors(ckpt, manifest, model, spec)
    shards = plan_shards(tensors, dtype, max_shard_size)
    config = export_config(spec, model, dtype)
    copies = tokenizer_files(tokenizer) if tokenizer else []
    out = Path(out_dir)
    check_target(out)
    with staged(out) as tmp:
        check_files(ckpt, manifest)  # every file, whole, before any tensor is read
        if manifest.get("frozen_source") is not None:  # and the files the frozen weights are kept in
            check_share(manifest["frozen_source"], 0, 1)
        _write(ckpt, manifest, tmp, config, shards, dtype, copies)
    return {"tensors": len(tensors), "parameters": sum(t.numel for t in tensors), "files": len(shards),
            "bytes": sum(t.numel for t in tensors) * dtype.itemsize}


def _write(ckpt: Path, manifest: dict, tmp: Path, config: dict, shards: list[list[OutTensor]],
           dtype: torch.dtype, copies: list[tuple[Path, str]]) -> None:
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = shard_file_names(len(shards))
    file_mode = (tmp / "config.json").stat().st_mode & 0o777  # 0666 under the user's umask
    whole = CheckpointWeights(ckpt, checked=True)  # frozen and merged parameters; the files are checked already
    with contextlib.ExitStack() as stack:
        try:
            handles = {f: stack.enter_context(safe_open(str(ckpt / f), framework="pt")) for f in manifest["files"]}
        except Exception as e:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {type(e).__name__}: {e}") from None
        for name, shard in zip(files, shards):
            try:
                tensors = {t.key: read_tensor(handles, manifest, t, dtype, whole) for t in shard}
            except Exception as e:  # a truncated file of a checkpoint from before checksums
                raise CheckpointError(f"checkpoint {ckpt} is corrupt: {type(e).__name__}: {e}") from None
            try:
                save_file(tensors, str(tmp / name), metadata={"format": "pt"})  # older transformers need "pt"
            except Exception as e:  # safetensors' own error for a failed write (a full disk) is no OSError
                raise OSError(str(e).splitlines()[0] if str(e) else repr(e)) from None
            del tensors  # freed before the next shard is read
            os.chmod(tmp / name, file_mode)  # safetensors creates files 0600; these are for sharing, like config.json
    if len(shards) > 1:  # always the index when sharded (torchtitan #2137: without it nothing loads)
        weight_map = {t.key: name for name, shard in zip(files, shards) for t in shard}
        index = {"metadata": {"total_size": sum(t.numel for s in shards for t in s) * dtype.itemsize},
                 "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for source, name in copies:
        shutil.copyfile(source, tmp / name)
