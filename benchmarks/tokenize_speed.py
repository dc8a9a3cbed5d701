"""Tokenization throughput: python -m train.prepare end to end against plain `tokenizers` loops.

Usage: python benchmarks/tokenize_speed.py [--mb 16] [--vocab 4096] [--repeats 3]

Documents are the built-in corpus's files (train/data.py: the standard library's .py sources in
sorted path order, up to --mb MiB; the few that are not UTF-8 left out), one document per file.
The tokenizer is a byte-level BPE of --vocab entries trained by tests/tokenizer.py on the first
MiB of them. Rows:
- `encode` per document: the loop a first script writes, one call per document, one core;
- `encode_batch` over all documents held in memory: every core, offsets computed;
- `encode_batch_fast` likewise, without offsets (what train.prepare calls, batch by batch);
- `train.prepare` end to end: reading the files (from the page cache), encoding in batches,
  splitting, writing train.bin/val.bin/meta.json, and the renames.
MB/s counts the documents' UTF-8 bytes; tokens/s the documents' tokens (not the end-of-text ids
train.prepare appends). Each row is the best of --repeats runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from tests.tokenizer import train_tokenizer  # noqa: E402
from train import prepare  # noqa: E402
from train.data import stdlib_files  # noqa: E402


def corpus(cap: int) -> tuple[list[Path], list[str]]:
    """The built-in corpus's files, up to `cap` bytes, and their texts."""
    files, texts, size = [], [], 0
    for path in stdlib_files():
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        files.append(path)
        texts.append(text)
        size += len(text.encode())
        if size >= cap:
            break
    return files, texts


def best(fn, repeats: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of all the process's threads, tokens counted) of the fastest run. CPU
    over wall says how many cores a method kept busy."""
    runs = []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = fn()
        runs.append((time.perf_counter() - t0, time.process_time() - c0, tokens))
    return min(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=16, help="MiB of documents (default 16: the built-in corpus's size)")
    p.add_argument("--vocab", type=int, default=4096, help="entries of the trained BPE (default 4096)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    files, texts = corpus(int(a.mb * 2**20))
    nbytes = sum(len(t.encode()) for t in texts)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tok_path = Path(tmp) / "tokenizer.json"
        train_tokenizer(tok_path, [t[:200_000] for t in _first_bytes(texts, 1 << 20)], vocab_size=a.vocab)
        train_s = time.perf_counter() - t0
        tokenizer, _ = prepare.load_tokenizer(tok_path)  # as train.prepare sets it up (no truncation, ...)

        def prepared() -> int:
            meta = prepare.prepare(tok_path, Path(tmp) / "data", [str(f) for f in files])
            return meta["train_tokens"] + meta["val_tokens"] - meta["train_documents"] - meta["val_documents"]

        rows = [
            ("encode, one document at a time", lambda: sum(len(tokenizer.encode(t, add_special_tokens=False).ids)
                                                          for t in texts)),
            ("encode_batch, all in memory", lambda: sum(len(e.ids) for e in
                                                        tokenizer.encode_batch(texts, add_special_tokens=False))),
            ("encode_batch_fast, all in memory", lambda: sum(len(e.ids) for e in
                                                             tokenizer.encode_batch_fast(texts, add_special_tokens=False))),
            ("train.prepare, files to train.bin", prepared),
        ]
        results = [(name, *best(fn, a.repeats)) for name, fn in rows]
    print(f"{len(texts)} documents, {nbytes / 1e6:.1f} MB; byte-level BPE of {a.vocab} entries (trained in "
          f"{train_s:.2f} s); {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; best of {a.repeats}")
    base = results[0][1]
    print(f"| {'method':36} | {'s':>6} | {'CPU s':>6} | {'MB/s':>6} | {'tokens/s':>10} | {'speed-up':>8} |")
    print(f"|{'-' * 38}|{'-' * 8}|{'-' * 8}|{'-' * 8}|{'-' * 12}|{'-' * 10}|")
    for name, seconds, cpu, tokens in results:
        print(f"| {name:36} | {seconds:6.2f} | {cpu:6.2f} | {nbytes / seconds / 1e6:6.2f} | {tokens / seconds:10,.0f} | "
              f"{base / seconds:7.2f}x |")
    counts = {tokens for *_, tokens in results}
    assert len(counts) == 1, f"the methods disagree on the token count: {sorted(counts)}"


def _first_bytes(texts: list[str], cap: int) -> list[str]:
    out, size = [], 0
    for t in texts:
        if size >= cap:
            break
        out.append(t)
        size += len(t)
    return out


if __name__ == "__main__":
    main()
