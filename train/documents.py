"""The documents python -m train.prepare reads: the files its arguments name, as texts, in batches.

A plain file is one document; a .jsonl file holds one document per line, in its "text" field.
Directories are walked in sorted path order, leaving out hidden names and the output directory.
Anything unreadable is a DataError that names the file (and the line).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from train.data import DataError, one_line

BATCH_BYTES = 1 << 20   # text per encode_batch call: documents for every core; its encodings take ~70x
BATCH_DOCUMENTS = 1 << 16


def input_files(paths: list[str | Path], out: Path) -> tuple[list[Path], int]:
    """The files the arguments name, in order, and their bytes; each directory's files in sorted path order,
    leaving out hidden names (.git, editor files) and anything under the output directory."""
    out, files = out.resolve(), []
    try:
        for arg in map(Path, paths):
            if arg.is_file():
                files.append(arg)
            elif arg.is_dir():
                files += [f for f in sorted(arg.rglob("*")) if f.is_file() and out not in f.resolve().parents
                          and not any(part.startswith(".") for part in f.relative_to(arg).parts)]
            else:
                raise DataError(f"input {arg} does not exist")
        return files, sum(f.stat().st_size for f in files)
    except OSError as e:
        raise DataError(f"input {e.filename} cannot be read: {one_line(e)}") from None


def documents(files: list[Path]) -> Iterator[tuple[str, int]]:
    """(text, bytes read) for each document, in order; a file that cannot be read is a DataError naming it."""
    for file in files:
        try:
            if file.suffix.lower() == ".jsonl":
                yield from _jsonl_documents(file)
            else:
                raw = file.read_bytes()
                yield _utf8(raw, file), len(raw)
        except OSError as e:
            raise DataError(f"input {file} cannot be read: {one_line(e)}") from None


def _jsonl_documents(file: Path) -> Iterator[tuple[str, int]]:
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue  # a blank line (often the last) holds no document
            where = f"{file} line {number}"
            try:
                record = json.loads(_utf8(line, where))
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not JSON: {e.msg} at column {e.colno}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{where} is not a JSON object with a \"text\" string")
            text = record["text"]
            try:  # JSON can spell a lone surrogate (\ud800), which no tokenizer takes
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{where}: its text holds a lone surrogate at character {e.start}, not Unicode "
                                f"text") from None
            yield text, len(line)


def _utf8(raw: bytes, where) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text (byte {e.start})") from None


def batches(files: list[Path]) -> Iterator[tuple[list[str], int]]:
    """The documents in batches of about BATCH_BYTES: (texts, bytes read)."""
    texts, size = [], 0
    for text, nbytes in documents(files):
        texts.append(text)
        size += nbytes
        if size >= BATCH_BYTES or len(texts) >= BATCH_DOCUMENTS:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size
