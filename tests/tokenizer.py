"""Tokenizers built here for tests, so that no test downloads one.

`train_tokenizer` trains a small byte-level BPE (GPT-2's kind: every byte is a token, so any text
round-trips exactly) with `<|endoftext|>` as its special token, on whatever text a test gives it.
"""
from __future__ import annotations

import json

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"
CHUNK_CHARS = 4096  # the trainer counts pairs per input string: short strings keep that cheap and parallel


def train_tokenizer(path: str | Path, texts: Iterable[str], vocab_size: int = 512, bos: str | None = None
                    ) -> Tokenizer:
    """A byte-level BPE of `vocab_size` entries (at least the 256 bytes and EOS) trained on `texts`, saved
    as tokenizer.json at `path`. A few hundred KB of text trains in about 0.1 s. With `bos`, its
    post-processor puts that token before every sequence, as Llama 3's does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_chunks(texts), trainer=trainer)
    if bos:
        _add_bos(tokenizer, bos)
    tokenizer.save(str(path))
    return tokenizer


def word_tokenizer(path: str | Path, words: int) -> Tokenizer:
    """A WordLevel tokenizer of `words` entries w0 ... w{words-1} split on whitespace, then [UNK] and EOS,
    saved at `path`: enough entries for a vocabulary past uint16, built in a fraction of a second."""
    vocab = {f"w{i}": i for i in range(words)}
    vocab["[UNK]"] = words
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([EOS])
    tokenizer.save(str(path))
    return tokenizer


def _add_bos(tokenizer: Tokenizer, bos: str) -> None:
    tokenizer.add_special_tokens([bos])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])


def _chunks(texts: Iterable[str]) -> Iterable[str]:
    for text in texts:
        for i in range(0, len(text), CHUNK_CHARS):
            yield text[i:i + CHUNK_CHARS]


def write_corpus(root: Path, docs: list[str], jsonl_from: int) -> list[str]:
    """Documents [:jsonl_from] as plain files in nested directories, the rest as lines of a .jsonl file that
    sorts after them; the argument that names them all."""
    for i, doc in enumerate(docs[:jsonl_from]):
        (root / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"d{i % 3}" / f"{i:04d}.txt").write_bytes(doc.encode())
    (root / "z.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[jsonl_from:])))
    return [str(root)]
