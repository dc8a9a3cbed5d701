"""python -m train.prepare: text into train.bin/val.bin/meta.json. The trainer reading them: test_data.py."""
from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, models, normalizers, processors

from tests.tokenizer import EOS, train_tokenizer, word_tokenizer, write_corpus
from train import documents, prepare

EDGE_DOCS = ["", "\n\n", "héllo wörld 🌍\r\n", f"text that spells {EOS} is text, not a boundary", " leading space"]


def read_back(out: Path, tokenizer: Tokenizer) -> tuple[dict, dict[str, list[str]]]:
    """meta.json, and each split's documents decoded (the ids between end-of-text ids, after the
    beginning-of-text ids meta.json names, which each must start with)."""
    meta = json.loads((out / "meta.json").read_text())
    bos = meta["bos_ids"]
    docs = {}
    for name in ("train", "val"):
        ids = np.fromfile(out / f"{name}.bin", dtype=meta["dtype"]).tolist()
        assert len(ids) == meta[f"{name}_tokens"] and ids[-1] == meta["eos_id"]
        cuts = [-1] + [i for i, t in enumerate(ids) if t == meta["eos_id"]]
        pieces = [ids[a + 1:b] for a, b in zip(cuts, cuts[1:])]
        assert all(piece[:len(bos)] == bos for piece in pieces)
        docs[name] = [tokenizer.decode(piece[len(bos):], skip_special_tokens=False) for piece in pieces]
        assert len(docs[name]) == meta[f"{name}_documents"]
    return meta, docs


def run(argv, capsys) -> tuple[int, str]:
    code = prepare.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_round_trip_gives_back_every_document_once(tmp_path, tok, texts, capsys):
    docs = EDGE_DOCS + texts
    code, err = run(["--tokenizer", tok, "--out", tmp_path / "data", "--val-fraction", "0.1",
                     *write_corpus(tmp_path / "src", docs, jsonl_from=30)], capsys)
    assert code == 0, err
    meta, split = read_back(tmp_path / "data", Tokenizer.from_file(str(tok)))
    assert Counter(split["train"]) + Counter(split["val"]) == Counter(docs)
    assert len(split["train"]) + len(split["val"]) == len(docs) and split["val"]
    ids = np.concatenate([np.fromfile(tmp_path / "data" / f"{n}.bin", dtype=meta["dtype"]) for n in ("train", "val")])
    assert meta["max_id"] == ids.max() and meta["vocab_size"] == 512 and meta["dtype"] == "uint16"
    assert meta["eos_id"] == Tokenizer.from_file(str(tok)).token_to_id(EOS)


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.text(max_size=60), min_size=2, max_size=12), fraction=st.floats(0.01, 0.99))
def test_any_text_round_trips_in_whole_documents(tok, docs, fraction):
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp), docs, jsonl_from=len(docs) // 2)
        meta = prepare.prepare(tok, Path(tmp) / "data", [tmp], val_fraction=fraction)
        _, split = read_back(Path(tmp) / "data", Tokenizer.from_file(str(tok)))
    assert Counter(split["train"]) + Counter(split["val"]) == Counter(docs)
    assert meta["train_documents"] >= 1 and meta["val_documents"] >= 1


@pytest.mark.parametrize("count,fraction,val", [(2, 1e-9, (1, 1)), (3, 1 - 1e-9, (1, 2)), (3000, 0.1, (240, 360))])
def test_split_is_whole_documents_about_the_fraction_at_least_one_each(tmp_path, tok, count, fraction, val):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(count)))
    meta = prepare.prepare(tok, tmp_path / "data", [str(tmp_path / "docs.jsonl")], val_fraction=fraction)
    assert val[0] <= meta["val_documents"] <= val[1] and meta["train_documents"] == count - meta["val_documents"]


def test_output_is_deterministic_and_independent_of_batching(tmp_path, tok, texts, monkeypatch):
    src = write_corpus(tmp_path / "src", EDGE_DOCS + texts, jsonl_from=20)
    prepare.prepare(tok, tmp_path / "a", src, val_fraction=0.2)
    prepare.prepare(tok, tmp_path / "b", src, val_fraction=0.2)
    monkeypatch.setattr(documents, "BATCH_BYTES", 1000)  # many batches: document indices must run on across them
    prepare.prepare(tok, tmp_path / "c", src, val_fraction=0.2)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes() \
            == (tmp_path / "c" / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.parametrize("words,dtype", [(65534, "uint16"), (65535, "uint32"), (70000, "uint32")])
def test_ids_past_uint16_are_written_as_uint32(tmp_path, words, dtype):
    tokenizer = word_tokenizer(tmp_path / "tok.json", words)  # words + [UNK] + EOS entries
    (tmp_path / "a.txt").write_text(f"w{words - 1} w7 w{words - 2}")
    (tmp_path / "b.txt").write_text("w0 unknown")
    meta = prepare.prepare(tmp_path / "tok.json", tmp_path / "data", [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert meta["dtype"] == dtype and meta["vocab_size"] == words + 2 and meta["max_id"] == words + 1
    ids = np.concatenate([np.fromfile(tmp_path / "data" / f"{n}.bin", dtype=dtype) for n in ("train", "val")])
    assert sorted(ids.tolist()) == sorted([words - 1, 7, words - 2, words + 1, 0, words, words + 1])
    assert tokenizer.token_to_id(EOS) == words + 1


BOT = "<|begin_of_text|>"


def test_no_doubled_bos_from_a_post_processor_that_adds_one(tmp_path, texts):
    """Llama 3's kind: by default (--bos auto) every document starts with the processor's BOS, once."""
    tokenizer = train_tokenizer(tmp_path / "tok.json", texts[:5], bos=BOT)
    bos = tokenizer.token_to_id(BOT)
    assert tokenizer.encode("x").ids[0] == bos  # the processor adds it
    meta = prepare.prepare(tmp_path / "tok.json", tmp_path / "data", write_corpus(tmp_path / "src", texts[:6], 3))
    _, split = read_back(tmp_path / "data", tokenizer)  # each document starts with meta's bos_ids
    assert meta["bos_ids"] == [bos] and meta["eos_id"] != bos
    assert Counter(split["train"] + split["val"]) == Counter(texts[:6])  # a second BOS would decode as its text
    ids = np.concatenate([np.fromfile(tmp_path / "data" / f"{n}.bin", "uint16") for n in ("train", "val")])
    assert (ids == bos).sum() == len(texts[:6])


def _specials_tokenizer(path: Path, texts: list[str], kind: str) -> Tokenizer:
    """llama3: a post-processor that adds <|begin_of_text|>; gpt2: GPT-2's ByteLevel one, adding nothing, and
    no BOS token; gpt2+bos: the same with <|begin_of_text|> among its special tokens."""
    tokenizer = train_tokenizer(path, texts, bos=BOT if kind != "gpt2" else None)
    if kind == "gpt2+bos":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        tokenizer.save(str(path))
    return tokenizer


@pytest.mark.parametrize("kind,flag,writes_bos", [
    ("llama3", "auto", True), ("llama3", "always", True), ("llama3", "never", False),
    ("gpt2", "auto", False), ("gpt2", "never", False),
    ("gpt2+bos", "auto", False), ("gpt2+bos", "always", True), ("gpt2+bos", "never", False)])
def test_bos_follows_the_post_processor_or_the_flag(tmp_path, texts, capsys, kind, flag, writes_bos):
    tokenizer = _specials_tokenizer(tmp_path / "tok.json", texts[:5], kind)
    code, err = run(["--tokenizer", tmp_path / "tok.json", "--out", tmp_path / "data", "--bos", flag,
                     *write_corpus(tmp_path / "src", texts[:6], 3)], capsys)
    assert code == 0, err
    meta, split = read_back(tmp_path / "data", tokenizer)
    assert meta["bos_ids"] == ([tokenizer.token_to_id(BOT)] if writes_bos else [])
    assert Counter(split["train"] + split["val"]) == Counter(texts[:6])


def test_a_truncation_setting_in_tokenizer_json_cuts_nothing(tmp_path, tok, texts):
    tokenizer = Tokenizer.from_file(str(tok))
    tokenizer.enable_truncation(max_length=4)
    tokenizer.save(str(tmp_path / "tok.json"))
    prepare.prepare(tmp_path / "tok.json", tmp_path / "data", write_corpus(tmp_path / "src", texts[:4], 4))
    _, split = read_back(tmp_path / "data", Tokenizer.from_file(str(tok)))
    assert Counter(split["train"] + split["val"]) == Counter(texts[:4])


def test_a_directory_walk_leaves_out_hidden_files_and_the_output(tmp_path, tok):
    src = write_corpus(tmp_path / "src", ["one", "two", "three"], jsonl_from=2)
    _file(tmp_path / "src" / ".git" / "objects" / "ab", b"\x78\x9c binary")
    _file(tmp_path / "src" / ".notes.txt", b"hidden")
    first = prepare.prepare(tok, tmp_path / "src" / "data", src)
    again = prepare.prepare(tok, tmp_path / "src" / "data", src)  # the first run's output lies under src/ now
    assert first == again and first["train_documents"] + first["val_documents"] == 3


@pytest.mark.parametrize("specials,flag,expected", [(["</s>"], None, "</s>"), (["<|end_of_text|>"], None, "<|end_of_text|>"),
                                                     (["<|im_end|>", "<|endoftext|>"], None, "<|endoftext|>"),
                                                     (["<|im_end|>", "<|endoftext|>"], "<|im_end|>", "<|im_end|>")])
def test_end_of_text_found_by_its_usual_names_or_named(specials, flag, expected):
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.add_special_tokens(specials)
    assert prepare.find_eos(tokenizer, flag, "t.json") == tokenizer.token_to_id(expected)


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------------

def _bad_tokenizer(tmp: Path, text: str | None) -> Path:
    path = tmp / "bad.json"
    if text is None:
        Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    else:
        path.write_text(text)
    return path


BAD = {  # name: (what the case changes, given the tmp directory; words of the error). Unchanged: --tokenizer
    # the good one, --out a new directory, and the inputs src/; a bad document comes after src/'s, with a
    # previous run's output in data/ that must stay intact.
    "tokenizer missing": (lambda t: dict(tokenizer=t / "no.json"), "does not exist"),
    "tokenizer a directory": (lambda t: dict(tokenizer=t), "is a directory"),
    "tokenizer not JSON": (lambda t: dict(tokenizer=_bad_tokenizer(t, "{not json")), "not a valid tokenizer"),
    "tokenizer other JSON": (lambda t: dict(tokenizer=_bad_tokenizer(t, '{"a": 1}')), "not a valid tokenizer"),
    "no end of text": (lambda t: dict(tokenizer=_bad_tokenizer(t, None)), "--eos"),
    "--eos not a token": (lambda t: dict(extra=["--eos", "<nope>"]), "is not a token"),
    "--bos always, no BOS": (lambda t: dict(extra=["--bos", "always"]), "--bos always: tokenizer"),
    "--bos a word": (lambda t: dict(extra=["--bos", "first"]), "invalid choice"),
    "BOS cannot be told": (lambda t: dict(tokenizer=_blind_tokenizer(t)), "--bos always or --bos never"),
    "input missing": (lambda t: dict(inputs=[t / "src", t / "nothing"]), "does not exist"),
    "no documents": (lambda t: dict(inputs=[_file(t / "empty" / "x.jsonl", b"\n \n")]), "no documents"),
    "one document": (lambda t: dict(inputs=[_file(t / "one.txt", b"x")]), "found 1 document"),
    "fraction 0": (lambda t: dict(extra=["--val-fraction", "0"]), "(0, 1)"),
    "fraction 1": (lambda t: dict(extra=["--val-fraction", "1"]), "(0, 1)"),
    "fraction nan": (lambda t: dict(extra=["--val-fraction", "nan"]), "(0, 1)"),
    "fraction a word": (lambda t: dict(extra=["--val-fraction", "half"]), "invalid float"),
    "unknown flag": (lambda t: dict(extra=["--bogus"]), "unrecognized arguments"),
    "no --out": (lambda t: dict(out=None), "required: --out"),
    "out a file": (lambda t: dict(out=_file(t / "f", b"")), "cannot be written"),
    "out under a file": (lambda t: dict(out=_file(t / "f", b"") / "sub"), "cannot be written"),
    "jsonl not JSON": (lambda t: _late(t, "z.jsonl", b'{"text": "a"}\n\n{"te'), "z.jsonl line 3 is not JSON"),
    "jsonl no text": (lambda t: _late(t, "z.jsonl", b'{"text": "a"}\n{"t": "b"}\n'), "z.jsonl line 2"),
    "jsonl text a number": (lambda t: _late(t, "z.jsonl", b'{"text": 5}\n'), "z.jsonl line 1"),
    "jsonl a list": (lambda t: _late(t, "z.jsonl", b"[1]\n"), "z.jsonl line 1"),
    "jsonl surrogate": (lambda t: _late(t, "z.jsonl", b'{"text": "a\\ud800"}\n'), "line 1: its text holds a lone surrogate"),
    "jsonl not UTF-8": (lambda t: _late(t, "z.jsonl", b'{"text": "\xff"}\n'), "z.jsonl line 1 is not UTF-8"),
    "file not UTF-8": (lambda t: _late(t, "z.txt", b"ok \xc3\x28"), "z.txt is not UTF-8"),
}


def _blind_tokenizer(tmp: Path) -> Path:
    """A post-processor that adds a token, but the probe that finds where it puts it encodes to nothing."""
    path = tmp / "blind.json"
    tokenizer = Tokenizer(models.WordLevel({"b": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.add_special_tokens([EOS, BOT])
    tokenizer.normalizer = normalizers.Replace("a", "")
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOT} $A", special_tokens=[(BOT, 3)])
    tokenizer.save(str(path))
    return path


def _file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _late(tmp: Path, name: str, data: bytes) -> dict:
    """A bad document after the good ones, into the directory a previous run wrote."""
    return dict(inputs=[tmp / "src", _file(tmp / "late" / name, data)], out=tmp / "data")


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_exit_2_and_leaves_the_output_as_it_was(name, tmp_path, tok, capsys, monkeypatch):
    prepare.prepare(tok, tmp_path / "data", write_corpus(tmp_path / "src", ["first", "second", "third"], 3))
    monkeypatch.setattr(documents, "BATCH_BYTES", 1)  # so that batches are written before a late bad document
    make, words = BAD[name]
    case = dict(tokenizer=tok, out=tmp_path / "new", inputs=[tmp_path / "src"], extra=[]) | make(tmp_path)
    args = ["--tokenizer", case["tokenizer"], *(["--out", case["out"]] if case["out"] else []), *case["extra"],
            *case["inputs"]]
    before = _tree(tmp_path)
    code, err = run(args, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert words in err and "Traceback" not in err, err
    assert _tree(tmp_path) == before  # no partial or temporary files, no new directory, old output intact
