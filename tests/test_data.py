"""train/data.py reading what train.prepare wrote (a DATA_DIR as --data), and the byte corpus as before."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tokenizer import write_corpus
from train import prepare
from train.data import DataError, check_vocab, global_batch_starts, load_corpus, load_tokens, rank_batch, val_batches


def old_rank_batch(tokens, step, micro_batch, world_size, rank, seq, seed, grad_accum=1, micro_step=0):
    """rank_batch as it was before data directories (commit cad751b): the byte path must not change."""
    size = micro_batch * world_size * grad_accum
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq, (size,), generator=gen)
    lo = (micro_step * world_size + rank) * micro_batch
    rows = torch.stack([tokens[s:s + seq + 1] for s in starts[lo:lo + micro_batch].tolist()]).long()
    return rows[:, :-1], rows[:, 1:], (seed << 40) + (step - 1) * size + torch.arange(lo, lo + micro_batch)


def test_byte_corpus_batches_are_unchanged(tmp_path, texts):
    (tmp_path / "bytes.txt").write_text("".join(texts))
    corpus = load_corpus(str(tmp_path / "bytes.txt"), 16)
    assert corpus.vocab_size == 256 and corpus.val is None and corpus.eos_id is None and corpus.train.dtype == torch.uint8
    assert torch.equal(load_tokens(str(tmp_path / "bytes.txt"), 16), corpus.train)
    for step, world, rank, accum, micro, seed in [(1, 1, 0, 1, 0, 0), (7, 3, 2, 2, 1, 5), (100, 2, 1, 4, 3, 1)]:
        new = rank_batch(corpus, step, 4, world, rank, 16, seed, accum, micro)
        for a, b in zip(new, old_rank_batch(corpus.train, step, 4, world, rank, 16, seed, accum, micro)):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture()
def data_dir(tmp_path, tok, texts) -> Path:
    prepare.prepare(tok, tmp_path / "data", write_corpus(tmp_path / "src", texts, 20), val_fraction=0.2)
    return tmp_path / "data"


def test_data_dir_windows_come_from_the_memory_map(data_dir):
    corpus = load_corpus(str(data_dir), 32)
    assert isinstance(corpus.train, np.memmap) and not corpus.train.flags.writeable and corpus.eos_id == 0
    x, y, _ = rank_batch(corpus, 3, 2, 2, 1, 32, 9, grad_accum=2, micro_step=1)
    starts = global_batch_starts(len(corpus.train), 3, 8, 32, 9)[6:8].tolist()
    want = torch.tensor(np.stack([corpus.train[s:s + 33] for s in starts]).astype(np.int64))
    assert x.dtype == torch.int64 and torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])


def test_check_vocab_names_the_id_and_the_vocabulary(data_dir):
    corpus = load_corpus(str(data_dir), 32)
    check_vocab(corpus, corpus.max_id + 1)
    with pytest.raises(DataError, match=rf"token id {corpus.max_id}\b.*vocabulary of {corpus.max_id}\b") as e:
        check_vocab(corpus, corpus.max_id)
    assert "\n" not in str(e.value)
    (data_dir / "bytes.txt").write_bytes(bytes(range(200)))
    check_vocab(load_corpus(str(data_dir / "bytes.txt"), 32), 200)  # bytes: the largest byte present counts
    with pytest.raises(DataError, match="token id 199, beyond the model's vocabulary of 199"):
        check_vocab(load_corpus(str(data_dir / "bytes.txt"), 32), 199)


def test_val_batches_are_fixed_and_rank_rows_partition_the_global_batch(data_dir):
    corpus = load_corpus(str(data_dir), 16)
    whole = val_batches(corpus, 3, 6, 1, 0, 16)
    again = val_batches(corpus, 3, 6, 1, 0, 16)
    for world in (2, 3):
        parts = [val_batches(corpus, 3, 6 // world, world, r, 16) for r in range(world)]
        for b in range(3):
            for i in (0, 1):
                assert torch.equal(torch.cat([p[b][i] for p in parts]), whole[b][i])
    assert all(torch.equal(a, b) for (x1, y1), (x2, y2) in zip(whole, again) for a, b in ((x1, x2), (y1, y2)))
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in whole)
    starts = {tuple(x[j].tolist()) for x, _ in whole for j in range(6)}
    assert len(starts) == 18  # distinct windows, spread over the held-out tokens
    (data_dir / "bytes.txt").write_bytes(bytes(range(200)))
    with pytest.raises(DataError, match="no validation tokens"):
        val_batches(load_corpus(str(data_dir / "bytes.txt"), 16), 1, 1, 1, 0, 16)
    with pytest.raises(DataError, match="fewer than one sequence"):
        val_batches(corpus, 1, 1, 1, 0, len(corpus.val))


BROKEN = {  # name: (what spoils a good data directory, words of the error)
    "no meta.json": (lambda d: (d / "meta.json").unlink(), "no meta.json"),
    "meta.json not JSON": (lambda d: (d / "meta.json").write_text("{"), "cannot be read"),
    "meta.json a list": (lambda d: (d / "meta.json").write_text("[]"), "not a JSON object"),
    "dtype unknown": (lambda d: _edit_meta(d, dtype="int8"), "dtype must be"),
    "max_id negative": (lambda d: _edit_meta(d, max_id=-1), "max_id must be"),
    "count a bool": (lambda d: _edit_meta(d, train_tokens=True), "train_tokens must be"),
    "no train.bin": (lambda d: (d / "train.bin").unlink(), "no train.bin"),
    "dtype disagrees": (lambda d: _edit_meta(d, dtype="uint32"), "train.bin has"),
    "train.bin cut short": (lambda d: (d / "train.bin").write_bytes((d / "train.bin").read_bytes()[:-2]), "train.bin has"),
    "val.bin of another run": (lambda d: (d / "val.bin").write_bytes(b"\0\0" * 3), "val.bin has"),
    "train shorter than a window": (lambda d: _edit_meta(d, train_tokens=10) or (d / "train.bin").write_bytes(b"\0" * 20),
                                    "fewer than one sequence"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_data_directory_is_one_line(data_dir, name):
    spoil, words = BROKEN[name]
    spoil(data_dir)
    with pytest.raises(DataError, match=words) as e:
        load_corpus(str(data_dir), 32)
    assert "\n" not in str(e.value)


def _edit_meta(d: Path, **fields) -> None:
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps(meta | fields))

