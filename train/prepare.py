"""python -m train.prepare: text into the token ids that `python -m train --data DATA_DIR` memory-maps.

    python -m train.prepare --tokenizer PATH/tokenizer.json --out DATA_DIR [--val-fraction F] [--eos TOKEN]
                            [--bos auto|always|never] FILES_OR_DIRS...

A plain file is one document; a .jsonl file holds one document per line, in its "text"
field. Directories are walked in sorted path order (hidden files and the output directory
left out). Every document is followed by the tokenizer's end-of-text id, and preceded by its
beginning-of-text id where its post-processor adds one (--bos auto; train/prepare_specials.py), and
whole documents, chosen by a hash of their index, go to val.bin. The output is nanoGPT's flat
layout: train.bin and val.bin of uint16 ids (uint32 past 65536 entries), and meta.json.

It streams: documents are read and encoded in batches (`encode_batch`: Rust, every core,
the next batch encoding while this one is written), so a corpus larger than memory is
fine; only a single document must fit. The files are written under temporary names and
renamed into place when complete. Bad input ends in one line on stderr and exit 2, with
nothing renamed and the temporary files removed.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from train.data import DataError, one_line
from train.documents import batches, input_files
from train.prepare_specials import BOS_MODES, EOS_NAMES, find_bos, find_eos
from zerofunc.usage import ArgumentParser, UsageError

EXIT_WRITE_FAILED = 1  # the output could not be written (disk full, ...): the temporary files are removed
EXIT_USAGE = 2         # bad input: flags, tokenizer, documents, output directory
EXIT_INTERRUPTED = 130
_MASK64 = (1 << 64) - 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m train.prepare",
                       description="Tokenize text files into train.bin, val.bin and meta.json for --data.")
    p.add_argument("--tokenizer", required=True, metavar="FILE", help="a Hugging Face tokenizer.json")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="the data directory to write (created if missing)")
    p.add_argument("--val-fraction", type=float, default=0.005, metavar="F",
                   help="share of the documents held out for evaluation, whole documents, at least one (default 0.005)")
    p.add_argument("--eos", default=None, metavar="TOKEN",
                   help="the token that ends each document (default: the tokenizer's end-of-text token, "
                        f"one of {' '.join(EOS_NAMES)})")
    p.add_argument("--bos", choices=BOS_MODES, default="auto",
                   help="the beginning-of-text token before each document: auto, where the tokenizer's post-processor "
                        "adds one (Llama 3, Llama 2, Gemma; not GPT-2, Qwen2), as tokenizer(text) does; always (the "
                        "post-processor's, else the tokenizer's <|begin_of_text|>, <s>, ...); never (default auto)")
    p.add_argument("inputs", nargs="+", metavar="FILES_OR_DIRS",
                   help="text files (one document each), .jsonl files (a document per line, its \"text\"), directories")
    a = p.parse_args(argv)
    if not 0 < a.val_fraction < 1:
        raise UsageError(f"--val-fraction must lie in (0, 1), got {a.val_fraction}")
    return a


def load_tokenizer(path: str | Path) -> tuple[Tokenizer, str]:
    """The tokenizer and the SHA-256 of the very bytes it was built from (recorded in meta.json, so that
    a run can tell which tokenizer its ids belong to)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"tokenizer {path} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"tokenizer {path} is a directory: name its tokenizer.json") from None
    except OSError as e:
        raise DataError(f"tokenizer {path} cannot be read: {one_line(e)}") from None
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for JSON it cannot read
        raise DataError(f"tokenizer {path} is not a valid tokenizer.json: {one_line(e)}") from None
    # A tokenizer.json may carry a truncation or padding setting (for a classifier): here it would cut
    # documents short or pad them silently.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    # A special token's text inside a document is text, not a document boundary: only the ids this
    # script appends end documents (tiktoken's encode_ordinary, which nanoGPT uses, does the same).
    tokenizer.encode_special_tokens = True
    return tokenizer, hashlib.sha256(raw).hexdigest()


def vocab_size(tokenizer: Tokenizer) -> int:
    """Entries the model's embedding needs: one past the largest id (added tokens may leave gaps)."""
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(tokenizer.get_vocab(True).values()) + 1)


def token_dtype(vocab: int) -> str:
    return "uint16" if vocab <= 1 << 16 else "uint32"


def is_val(index: int, fraction: float) -> bool:
    """Whether document `index` is held out: splitmix64 of the index against the fraction, so the split
    depends on the documents' order only, and is spread over the corpus rather than its first files."""
    z = (index + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) < fraction * 2.0**64


class SplitFile:
    """One of train.bin / val.bin, appended to under a temporary name until _commit renames it."""

    def __init__(self, final: Path, dtype: str):
        self.final, self.dtype = final, np.dtype(dtype)
        self.tmp = final.with_name(f".{final.name}.{os.getpid()}.partial")
        self.file = open(self.tmp, "wb")
        self.tokens = self.documents = 0
        self.last: list[int] = []  # the last document's ids: what moves if the other split would be empty

    def append(self, docs: list[list[int]]) -> int:
        """Append documents (their ids, EOS included); the largest id among them."""
        ids = np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype)
        self.file.write(ids.tobytes())
        self.tokens += len(ids)
        self.documents += len(docs)
        self.last = docs[-1]
        return int(ids.max())

    def pop_last(self) -> list[int]:
        """Remove the last document and return its ids."""
        ids, self.last = self.last, []
        self.tokens, self.documents = self.tokens - len(ids), self.documents - 1
        self.file.truncate(self.tokens * self.dtype.itemsize)  # truncate leaves the position past the new end
        self.file.seek(0, os.SEEK_END)
        return ids

    def close(self, keep: bool) -> None:
        """Close the file: kept (synced, ready to rename), or removed."""
        if keep:
            self.file.flush()
            os.fsync(self.file.fileno())
        self.file.close()
        if not keep:
            self.tmp.unlink(missing_ok=True)


def prepare(tokenizer_path: str | Path, out: str | Path, inputs: list[str | Path], val_fraction: float = 0.005,
            eos: Optional[str] = None, progress: bool = False, bos: str = "auto") -> dict:
    """Tokenize `inputs` into out/train.bin, val.bin and meta.json; returns the meta written."""
    tokenizer, sha = load_tokenizer(tokenizer_path)
    eos_id = find_eos(tokenizer, eos, str(tokenizer_path))
    bos_ids = find_bos(tokenizer, bos, str(tokenizer_path))
    vocab = vocab_size(tokenizer)
    dtype = token_dtype(vocab)
    out = Path(out)
    files, total_bytes = input_files(inputs, out)
    where = " ".join(map(str, inputs))
    if not files:
        raise DataError(f"no documents found in {where}")
    created, splits = not out.exists(), {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("train", "val"):
            splits[name] = SplitFile(out / f"{name}.bin", dtype)
    except OSError as e:
        _discard(out, created, splits)
        raise DataError(f"--out {out} cannot be written: {one_line(e)}") from None
    try:
        max_id = _encode_all(tokenizer, bos_ids, eos_id, files, total_bytes, splits, val_fraction, progress)
        total = splits["train"].documents + splits["val"].documents
        if total == 0:
            raise DataError(f"no documents found in {where}")
        if total < 2:
            raise DataError(f"found 1 document in {where}: training and validation need one each")
        # Hash-chosen splits may leave one side empty on a small corpus: move the last document across.
        for empty, full in (("val", "train"), ("train", "val")):
            if splits[empty].documents == 0:
                splits[empty].append([splits[full].pop_last()])
        meta = {"dtype": dtype, "vocab_size": vocab, "eos_id": eos_id, "bos_ids": bos_ids, "max_id": max_id,
                "train_tokens": splits["train"].tokens, "val_tokens": splits["val"].tokens,
                "train_documents": splits["train"].documents, "val_documents": splits["val"].documents,
                "tokenizer_sha256": sha, "tokenizer": str(Path(tokenizer_path).resolve())}
        for split in splits.values():
            split.close(keep=True)
        _commit(out, splits, meta)
    except BaseException:
        _discard(out, created, splits)
        raise
    return meta


def _discard(out: Path, created: bool, splits: dict) -> None:
    """Leave nothing behind: the temporary files, and the output directory if this run made it."""
    for split in splits.values():
        split.close(keep=False)
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()  # only if empty


def _encode_all(tokenizer: Tokenizer, bos_ids: list[int], eos_id: int, files: list[Path], total_bytes: int,
                splits: dict, val_fraction: float, progress: bool) -> int:
    """Stream every document through the tokenizer into its split; the largest id written.

    encode_batch releases the GIL while its threads work, so batch k + 1 is read and encoded while this
    thread turns batch k's encodings into ids and writes them: the Python side (about 0.1 us a token)
    would otherwise leave every core idle for its share of the time. (encode_batch_fast is encode_batch
    without the character offsets, which nothing here reads.)
    """
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing",
               file=sys.stderr, dynamic_ncols=True, disable=not progress)
    max_id, index = max([eos_id, *bos_ids]), 0

    def write(encoded, size: int) -> None:
        nonlocal max_id, index
        routed = {"train": [], "val": []}
        for enc in encoded.result():
            routed["val" if is_val(index, val_fraction) else "train"].append(bos_ids + enc.ids + [eos_id])
            index += 1
        for name, docs in routed.items():
            if docs:
                max_id = max(max_id, splits[name].append(docs))
        bar.update(size)

    with bar, ThreadPoolExecutor(1) as pool:
        pending = None
        for texts, size in batches(files):
            # the special tokens are bos_ids and eos_id, written here (train/prepare_specials.py)
            encoding = pool.submit(tokenizer.encode_batch_fast, texts, add_special_tokens=False), size
            if pending is not None:
                write(*pending)
            pending = encoding
        if pending is not None:
            write(*pending)
    return max_id


def _commit(out: Path, splits: dict, meta: dict) -> None:
    """Rename the finished files into place. The old meta.json goes first and the new one comes last, so
    that a crash in between leaves a directory the trainer refuses (no meta.json), never one whose
    meta.json describes other files."""
    meta_tmp = out / f".meta.json.{os.getpid()}.partial"
    try:
        meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        (out / "meta.json").unlink(missing_ok=True)
        for split in splits.values():
            os.replace(split.tmp, split.final)
        os.replace(meta_tmp, out / "meta.json")
    finally:
        meta_tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse(argv)
        meta = prepare(a.tokenizer, a.out, a.inputs, a.val_fraction, a.eos, progress=sys.stderr.isatty(), bos=a.bos)
    except (UsageError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # reading is checked (a DataError naming the input): this is the output
        print(f"error: writing {a.out} failed: {one_line(e)}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except KeyboardInterrupt:
        print("error: interrupted, nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"wrote {a.out}: {meta['train_tokens']:,} training tokens in {meta['train_documents']:,} documents, "
          f"{meta['val_tokens']:,} validation tokens in {meta['val_documents']:,} ({meta['dtype']}, vocabulary "
          f"{meta['vocab_size']:,}, beginning of text {' '.join(map(str, meta['bos_ids'])) or 'none'}, "
          f"end of text {meta['eos_id']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
