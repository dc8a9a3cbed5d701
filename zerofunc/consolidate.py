"""python -m zerofunc.consolidate: a checkpoint's full weights, as one file or as a Hugging Face model directory.

    python -m zerofunc.consolidate CKPT out.safetensors
    python -m zerofunc.consolidate CKPT OUT_DIR --hf [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]
                                   [--tokenizer PATH] [--model SPEC]
    python -m zerofunc.consolidate CKPT OUT_DIR --adapter [--model SPEC]

CKPT is a checkpoint directory or a run directory (its newest checkpoint is used). The single
file holds the fp32 masters under the model's own names and loads into the plain model:
model.load_state_dict(safetensors.torch.load_file(out)). With --hf, OUT_DIR becomes a
directory that `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads, written tensor by tensor
(zerofunc/hf_export.py); a `--lora` run's adapted weights are merged, W + (alpha / r) B A. With --adapter,
OUT_DIR becomes a PEFT adapter directory of a `--lora` run, which `PeftModel.from_pretrained(base, OUT_DIR)`
loads (zerofunc/peft_export.py). Bad input is one line `error: ...` and exit 2, with nothing written.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from zerofunc.checkpoint_files import CheckpointError, consolidated
from zerofunc.export_dir import ExportError
from zerofunc.hf_export import export
from zerofunc.hf_files import WeightsError
from zerofunc.peft_export import export_adapter
from zerofunc.usage import ArgumentParser, UsageError

HF_ONLY = ("dtype", "max_shard_size", "tokenizer")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# Hugging Face's size forms (transformers.utils.hub.convert_file_size_to_int), and fractions ("1.5GiB"):
# KiB/MiB/GiB are powers of 2, KB/MB/GB of 10, and a decimal unit ending in a lower-case "b" is bits, as there.
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?[Bb])?\s*", re.IGNORECASE)
_UNITS = {"K": 1, "M": 2, "G": 3, "T": 4}


def parse_dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise ExportError(f"--dtype {text!r} is not one of fp32, bf16, fp16") from None


def parse_size(text: str) -> int:
    """Bytes from "5GB", "500MB", "1.5GiB", "200KiB" or a plain number of bytes."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ExportError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB, 1.5GiB or 1000000")
    number, unit = float(m.group(1)), m.group(2)
    if unit is None:
        size = number
    elif unit[1:2].lower() == "i":
        size = number * 2 ** (10 * _UNITS[unit[0].upper()])
    else:
        size = number * 10 ** (3 * _UNITS[unit[0].upper()]) / (8 if unit.endswith("b") else 1)
    if size < 1:
        raise ExportError(f"--max-shard-size {text!r} is less than one byte")
    return int(size)


def parse(argv: list[str] | None):
    p = ArgumentParser(prog="python -m zerofunc.consolidate", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory")
    p.add_argument("out", help="the .safetensors file to write; with --hf, the model directory")
    p.add_argument("--hf", action="store_true", help="write a Hugging Face model directory (a --lora run's merged)")
    p.add_argument("--adapter", action="store_true", help="write a --lora run's adapters as a PEFT adapter directory")
    p.add_argument("--dtype", default=None, help="with --hf: fp32 (the masters; default), bf16 or fp16")
    p.add_argument("--max-shard-size", default=None,
                   help="with --hf: the largest weight file, as Hugging Face writes it: 5GB (default), 500MB, 1.5GiB")
    p.add_argument("--tokenizer", default=None,
                   help="with --hf: a tokenizer.json, or a directory holding one; copied with the tokenizer files "
                        "beside it")
    p.add_argument("--model", default=None,
                   help="with --hf or --adapter: the model (a preset, a config.json, or a directory holding one), where the "
                        "checkpoint does not record it or to override what it records")
    a = p.parse_args(argv)
    if a.hf and a.adapter:
        raise UsageError("--hf and --adapter write different directories: give one")
    given = [f"--{k.replace('_', '-')}" for k in HF_ONLY if getattr(a, k) is not None]
    if given and not a.hf:
        raise UsageError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --hf")
    if a.model is not None and not (a.hf or a.adapter):
        raise UsageError("--model needs --hf or --adapter")
    return a


def write_one_file(checkpoint: str, out: Path) -> str:
    weights = consolidated(checkpoint)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        save_file(weights, str(tmp))
        os.replace(tmp, out)  # never a half-written file under the real name
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror}") from None
    return f"wrote {len(weights)} tensors, {sum(t.numel() for t in weights.values()):,} parameters, to {out}"


def write_hf(a) -> str:
    dtype = parse_dtype(a.dtype or "fp32")
    size = parse_size(a.max_shard_size or "5GB")
    done = export(a.checkpoint, a.out, dtype=dtype, max_shard_size=size, tokenizer=a.tokenizer, model_spec=a.model)
    files = f"{done['files']} file{'s' if done['files'] > 1 else ''}"
    return (f"wrote {done['tensors']} tensors, {done['parameters']:,} parameters, {done['bytes'] / 1e6:,.1f} MB of "
            f"{str(dtype).removeprefix('torch.')} in {files}, to {a.out}")


def write_adapter(a) -> str:
    done = export_adapter(a.checkpoint, a.out, model_spec=a.model)
    return f"wrote the LoRA adapters of {done['modules']} modules, {done['parameters']:,} parameters, to {a.out}"


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse(argv)
        print(write_hf(a) if a.hf else write_adapter(a) if a.adapter else write_one_file(a.checkpoint, Path(a.out)))
    except (UsageError, CheckpointError, ExportError, WeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the partial output is already removed
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
