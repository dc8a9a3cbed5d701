"""Training data: bytes (a 256-token vocabulary), or the token ids `python -m train.prepare` wrote.

The built-in corpus is the running Python's own standard-library sources: real text
that is on every machine, so nothing is downloaded. `--data` may instead name a file
(its bytes are the tokens) or a DATA_DIR of train.bin, val.bin and meta.json, whose
token files are memory-mapped: a corpus larger than memory costs only the pages that
the drawn windows touch.

Batches are drawn per *global* batch from (seed, step), and a rank takes its rows of
it, so runs with different rank counts but the same global batch see the same data,
step for step, and a resumed run sees what the first one would have.
"""
from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

STDLIB_CAP_BYTES = 16 << 20  # enough text for any CPU run; reading all of it takes seconds
BYTE_VOCAB = 256
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}  # nanoGPT's flat layout: ids, native byte order
META_COUNTS = ("vocab_size", "max_id", "train_tokens", "val_tokens")

Tokens = Union[torch.Tensor, np.ndarray]  # a 1-D byte tensor, or a memory-mapped file of token ids


class DataError(ValueError):
    """The data cannot be used; the message says why in one line."""


@dataclass(frozen=True, eq=False)  # eq would compare the token arrays
class Corpus:
    """What the trainer reads: the training tokens, the held-out ones, and what the ids mean."""
    train: Tokens
    val: Optional[np.ndarray]  # None: nothing held out (the byte corpus)
    vocab_size: int            # the vocabulary the ids come from (256 for bytes)
    max_id: int                # the largest id in train and val: what the model's vocabulary must hold
    eos_id: Optional[int]      # the id that ends each document (None for bytes)
    source: str                # how messages name the corpus


def stdlib_corpus(cap: int = STDLIB_CAP_BYTES) -> bytes:
    """The standard library's .py sources in sorted path order, up to `cap` bytes."""
    out, size = [], 0
    for path in stdlib_files():
        try:
            chunk = path.read_bytes()
        except OSError:
            continue
        out.append(chunk)
        size += len(chunk)
        if size >= cap:
            break
    return b"".join(out)[:cap]


def stdlib_files() -> list[Path]:
    """The standard library's .py files in sorted path order (installed packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py"))
            if "site-packages" not in p.parts and "dist-packages" not in p.parts]


def load_corpus(path: str | None, seq: int) -> Corpus:
    """The corpus `--data` names: None is the built-in byte corpus, a file its bytes, a directory the
    token ids train.prepare wrote there. It must hold at least one training window of seq + 1 tokens."""
    if path is not None and Path(path).is_dir():
        return _token_corpus(Path(path), seq)
    if path is None:
        raw = stdlib_corpus()
        source = "the standard-library corpus"
    else:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"data file {path} does not exist")
        raw = p.read_bytes()
        source = f"data file {path}"
    if len(raw) == 0:
        raise DataError(f"{source} is empty")
    if len(raw) < seq + 1:
        raise DataError(f"{source} has {len(raw)} bytes, fewer than one sequence of {seq} + 1")
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return Corpus(tokens, None, BYTE_VOCAB, int(tokens.max()), None, source)


def load_tokens(path: str | None, seq: int) -> Tokens:
    """The training tokens alone (a uint8 tensor of bytes, or a memory-mapped train.bin); what
    rank_batch draws from. Kept for the callers that predate load_corpus."""
    return load_corpus(path, seq).train


def read_meta(root: Path) -> dict:
    """DATA_DIR/meta.json, checked: the fields the trainer relies on are there and make sense."""
    file = root / "meta.json"
    where = f"data directory {root}"
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise DataError(f"{where} has no meta.json: write it with python -m train.prepare") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{file} cannot be read: {one_line(e)}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{file} is not a JSON object")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise DataError(f"{file}: dtype must be one of {', '.join(TOKEN_DTYPES)}, got {meta.get('dtype')!r}")
    for key in META_COUNTS:
        if not _is_count(meta.get(key)):
            raise DataError(f"{file}: {key} must be a whole number >= 0, got {meta.get(key)!r}")
    if meta.get("eos_id") is not None and not _is_count(meta["eos_id"]):
        raise DataError(f"{file}: eos_id must be a whole number >= 0 or null, got {meta['eos_id']!r}")
    return meta


def _token_corpus(root: Path, seq: int) -> Corpus:
    meta = read_meta(root)
    source = f"data directory {root}"
    dtype = TOKEN_DTYPES[meta["dtype"]]
    train = _token_file(root / "train.bin", dtype, meta["train_tokens"], meta["dtype"])
    if train is None:
        raise DataError(f"{source} has no train.bin")
    if len(train) < seq + 1:
        raise DataError(f"{source} has {len(train)} training tokens, fewer than one sequence of {seq} + 1")
    val = _token_file(root / "val.bin", dtype, meta["val_tokens"], meta["dtype"])
    return Corpus(train, val, meta["vocab_size"], meta["max_id"], meta.get("eos_id"), source)


def _token_file(file: Path, dtype, count: int, dtype_name: str) -> Optional[np.ndarray]:
    """A read-only memory map of `count` ids, or None when the file is missing. A size that disagrees
    with meta.json means a file from another run, or one cut short: refuse it rather than train on it."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataError(f"{file} cannot be read: {one_line(e)}") from None
    expected = count * np.dtype(dtype).itemsize
    if size != expected:
        raise DataError(f"{file} has {size} bytes, but meta.json says {count} {dtype_name} tokens ({expected} bytes)")
    if count == 0:  # an empty file cannot be mapped
        return np.zeros(0, dtype=dtype)
    try:
        return np.memmap(file, dtype=dtype, mode="r", shape=(count,))
    except (OSError, ValueError) as e:
        raise DataError(f"{file} cannot be mapped: {one_line(e)}") from None


def check_vocab(corpus: Corpus, vocab_size: int) -> None:
    """Refuse a corpus whose ids a model of `vocab_size` entries cannot embed: an id past the table
    is an index error deep in a rank (or, on CUDA, a device-side assert), not a message."""
    if corpus.max_id >= vocab_size:
        raise DataError(f"{corpus.source} holds token id {corpus.max_id}, beyond the model's vocabulary of "
                        f"{vocab_size} (ids 0-{vocab_size - 1}); use a model whose vocabulary holds the tokenizer's "
                        f"{corpus.vocab_size} entries")


def global_batch_starts(n_tokens: int, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Start offsets of the global batch at `step`: a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_tokens - seq, (batch,), generator=gen)


def windows(tokens: Tokens, starts: list[int], seq: int) -> torch.Tensor:
    """Rows tokens[s : s + seq + 1] for each start, as int64 (what the embedding takes)."""
    if isinstance(tokens, torch.Tensor):
        return torch.stack([tokens[s:s + seq + 1] for s in starts]).long()
    return torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64))


def rank_batch(tokens: Tokens | Corpus, step: int, micro_batch: int, world_size: int, rank: int,
               seq: int, seed: int, grad_accum: int = 1, micro_step: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets, sample ids) for one micro-step of the global batch.

    The global batch holds micro_batch x world_size x grad_accum rows; micro-step j of
    rank r takes micro-batch j * world_size + r. A sample id names a row of the global
    batch of a run, (seed, step, row), whatever the rank count; per-sample randomness
    such as dropout is seeded from it.
    """
    if isinstance(tokens, Corpus):
        tokens = tokens.train
    size = micro_batch * world_size * grad_accum
    starts = global_batch_starts(len(tokens), step, size, seq, seed)
    lo = (micro_step * world_size + rank) * micro_batch
    hi = lo + micro_batch
    rows = windows(tokens, starts[lo:hi].tolist(), seq)
    ids = (seed << 40) + (step - 1) * size + torch.arange(lo, hi)
    return rows[:, :-1], rows[:, 1:], ids


def val_starts(n_tokens: int, n_windows: int, seq: int) -> list[int]:
    """Starts of `n_windows` windows spread evenly over the held-out tokens, first to last: a fixed set,
    so that every evaluation measures the same text and two val losses can be compared. (They overlap
    when val.bin is short, and repeat when it holds fewer starts than windows.)"""
    span = n_tokens - seq - 1  # the last window that fits starts here
    if n_windows == 1:
        return [0]
    return [i * span // (n_windows - 1) for i in range(n_windows)]


def val_batches(corpus: Corpus, count: int, micro_batch: int, world_size: int, rank: int, seq: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) of `count` global evaluation batches of micro_batch x world_size rows.

    The windows depend on the corpus and the global batch only (not on the seed, the step or the rank
    count), and rank r takes rows r * micro_batch ... of each, as rank_batch does.
    """
    if corpus.val is None:
        raise DataError(f"{corpus.source} holds no validation tokens (val.bin): write a data directory with "
                        f"python -m train.prepare to evaluate")
    if len(corpus.val) < seq + 1:
        raise DataError(f"{corpus.source} has {len(corpus.val)} validation tokens, fewer than one sequence of "
                        f"{seq} + 1")
    size = micro_batch * world_size
    starts = val_starts(len(corpus.val), count * size, seq)
    out = []
    for b in range(count):
        lo = b * size + rank * micro_batch
        rows = windows(corpus.val, starts[lo:lo + micro_batch], seq)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def one_line(e: BaseException) -> str:
    """An exception's message on one line (an OSError's or a JSON error's may hold newlines)."""
    return " ".join(str(e).split()) or type(e).__name__
