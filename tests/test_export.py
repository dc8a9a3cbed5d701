"""python -m zerofunc.consolidate CKPT OUT_DIR --hf: Hugging Face loads the export of each family strictly and
computes our logits; the files, the index, the config and the tokenizer are what it expects; bad input is one line.

The checkpoints are real saves (zerofunc.checkpoint.save, stage 3 on 2 gloo ranks, so the rank files split
units and some tensors straddle them) of three tiny models with random weights:
- llama: untied head, grouped-query attention 6:2; its spec is a model directory holding config.json;
- qwen2: tied head, q/k/v biases; its spec is a config.json file;
- gpt2: tied head, Conv1D weights; its spec is the preset gpt2-tiny.
"""
from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.bare import in_world
from zerofunc import hf_export
from zerofunc.checkpoint_files import consolidated
from zerofunc.consolidate import main as consolidate
from zerofunc.consolidate import parse_size
from zerofunc.export_dir import ExportError
from zerofunc.models import MODELS, build_model, hf_config_dict, model_config

QWEN2 = replace(MODELS["llama-tiny"], qkv_bias=True, tie_word_embeddings=True, model_type="qwen2")
USER_FIELDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # must survive the export
FAMILIES = ("llama", "qwen2", "gpt2")
TIED = {"llama": False, "qwen2": True, "gpt2": True}
# The logits of Hugging Face's model against ours, on the same weights. The two forwards differ only in the
# order of operations: GPT-2's Conv1D is addmm on an (in, out) weight where ours is linear on (out, in)
# (another matmul blocking, another summation order); elsewhere SDPA's kernel or a norm may fuse differently.
# Each fp32 forward then lies within the rounding r of the exact logits, which the test measures as our fp32
# forward's distance from our fp64 one (about 1.3e-6 on these weights, |logits| < 3), so the two differ by
# at most about 2r: the TOL of 1e-5 must exceed that, and the test asserts that it does. In fp64
# the same reordering moves the logits by about r * 2**-29 (measured: 3e-15 for GPT-2, 0 for the Llama
# family, whose op order is Hugging Face's); TOL64 leaves 300x of room above that, and a wrong, missing or
# transposed weight moves the logits by 1e-2 or more in either precision.
TOL = 1e-5
TOL64 = 1e-12


def random_init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Every weight random and different, biases and norm gains included, so each one shows in the logits."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.normal(0.0, 0.05, size=shape, generator=gen)
    return noise + 1.0 if "norm" in name or ".ln_" in name or name.startswith("ln_") else noise


def spec_config(spec: str):
    return model_config(str(Path(spec) / "config.json") if Path(spec).is_dir() else spec)


def save_checkpoints(specs: dict[str, tuple[str, int]], root: str) -> None:
    """On each rank: each model (spec, stage), initialized at random, saved once as the trainer saves it. Built
    on CPU, not meta: the first meta-device init imports torch._dynamo (seconds per rank)."""
    import zerofunc
    from zerofunc import checkpoint

    for name, (spec, stage) in specs.items():
        model = build_model(spec_config(spec))
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                p.copy_(random_init(param_name, tuple(p.shape)))
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
        engine = zerofunc.initialize(model, config, device="cpu")
        checkpoint.save(engine, Path(root) / name, 1, extra={"model": spec, "seed": 0})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    (llama_dir := root / "llama-model").mkdir()
    (llama_dir / "config.json").write_text(json.dumps({**hf_config_dict(MODELS["llama-tiny"]), **USER_FIELDS}))
    (root / "qwen2.json").write_text(json.dumps(hf_config_dict(QWEN2)))
    specs = {"llama": (str(llama_dir), 3), "qwen2": (str(root / "qwen2.json"), 3), "gpt2": ("gpt2-tiny", 3),
             "gpt2-stage0": ("gpt2-tiny", 0)}  # stage 0: one rank file holds every unit whole
    in_world(2, save_checkpoints, specs, str(root))
    return {name: root / name for name in specs}


def ours(run: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Our model of the run, loaded with the consolidated masters (rounded to `dtype` and back: an export in
    `dtype` holds exactly those values)."""
    manifest = json.loads((run / "checkpoints" / "step-00000001" / "manifest.json").read_text())
    model = build_model(spec_config(manifest["extra"]["model"]))
    model.load_state_dict({k: v.to(dtype).float() for k, v in consolidated(run).items()}, strict=True)
    return model.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(3))  # the same every call


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory) -> dict[str, Path]:
    """Each family exported in fp32, in several shards (--max-shard-size 100KB: ~1.8 MB of weights)."""
    root = tmp_path_factory.mktemp("hf")
    for family in FAMILIES:
        assert consolidate([str(runs[family]), str(root / family), "--hf", "--max-shard-size", "100KB"]) == 0
    return {family: root / family for family in FAMILIES}


def load_hf(out: Path, **kwargs):
    """Hugging Face's model from the directory, strictly. transformers is imported here, not at the top: the
    ranks that make the checkpoints import this module, and need not pay for it."""
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, **kwargs)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_hugging_face_loads_the_export_and_gives_our_logits(runs, exported, family):
    theirs = load_hf(exported[family])
    assert type(theirs).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "gpt2": "GPT2LMHeadModel"}[family]
    embedding, head = theirs.get_input_embeddings().weight, theirs.get_output_embeddings().weight
    assert (embedding.data_ptr() == head.data_ptr()) == TIED[family]  # still tied after load: one storage
    model = ours(runs[family])
    x = tokens(model.cfg.vocab_size)
    with torch.no_grad():
        ours32, theirs32 = model(x), theirs(input_ids=x).logits
        ours64, theirs64 = model.double()(x), theirs.double()(input_ids=x).logits
    rounding = (ours32 - ours64).abs().max().item()
    assert 2 * rounding <= TOL, f"fp32 rounding of {rounding:.1e} leaves no room under {TOL}"
    diff32, diff64 = (theirs32 - ours32).abs().max().item(), (theirs64 - ours64).abs().max().item()
    assert diff32 <= TOL, f"{family}: fp32 logits differ by {diff32:.2e} (rounding alone: {rounding:.1e})"
    assert diff64 <= TOL64, f"{family}: fp64 logits differ by {diff64:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_are_the_checkpoint_in_hugging_face_layout(runs, exported, family):
    out = exported[family]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    assert sorted(set(index["weight_map"].values())) == files  # every file indexed, every indexed file there
    masters, stored, total = consolidated(runs[family]), {}, 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}  # older transformers refuse files without it
            for key in f.keys():
                assert index["weight_map"][key] == name, f"{key} is in {name}, the index says elsewhere"
                stored[key] = f.get_tensor(key)
                total += stored[key].numel() * stored[key].element_size()
    assert index["metadata"]["total_size"] == total
    prefix = "transformer." if family == "gpt2" else ""
    expected = {prefix + n for n in masters}  # no head where tied, no placeholder, nothing left out
    assert stored.keys() == expected, f"extra {stored.keys() - expected}, missing {expected - stored.keys()}"
    for name, value in masters.items():
        conv1d = family == "gpt2" and name.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight"))
        assert torch.equal(stored[prefix + name], value.t() if conv1d else value), name  # Conv1D: (in, out)
    config = json.loads((out / "config.json").read_text())
    assert (config["torch_dtype"], config["dtype"]) == ("float32", "float32")
    if family == "llama":
        assert {k: config[k] for k in USER_FIELDS} == USER_FIELDS  # the user's own config.json, kept


def test_bf16_export_holds_the_masters_rounded(runs, tmp_path):
    out = tmp_path / "qwen2-bf16"
    assert consolidate([str(runs["qwen2"]), str(out), "--hf", "--dtype", "bf16", "--max-shard-size", "0.2MB"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert [config[k] for k in ("torch_dtype", "dtype", "architectures")] == ["bfloat16", "bfloat16",
                                                                             ["Qwen2ForCausalLM"]]
    masters = consolidated(runs["qwen2"])
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == sorted(masters)
    for key, file in weight_map.items():
        with safe_open(str(out / file), framework="pt") as f:
            stored = f.get_tensor(key)
            assert stored.dtype == torch.bfloat16 and torch.equal(stored, masters[key].to(torch.bfloat16)), \
                f"{key}: {stored.dtype}"
    assert load_hf(out).dtype == torch.bfloat16  # transformers 5 loads in the config's dtype
    theirs = load_hf(out, dtype=torch.float32)  # bf16 values are exact in fp32: the same forward as ours
    model = ours(runs["qwen2"], torch.bfloat16)
    x = tokens(model.cfg.vocab_size)
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - model(x)).abs().max().item() <= TOL


def test_a_small_model_is_one_file_with_the_tokenizer(runs, tmp_path, capsys):
    (tok := tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "merges.txt", "notes.txt"):
        (tok / name).write_text(f"{name} of this test")
    (out := tmp_path / "out").mkdir()  # an empty OUT_DIR is fine
    assert consolidate([str(runs["gpt2"]), str(out), "--hf", "--tokenizer", str(tok)]) == 0
    assert "in 1 file, to" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "merges.txt", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert (out / "merges.txt").read_text() == "merges.txt of this test"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    stage0 = tmp_path / "stage0"  # the same weights saved by stage 0 (one file) export to the same bytes
    assert consolidate([str(runs["gpt2-stage0"]), str(stage0), "--hf"]) == 0
    assert (stage0 / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    single = tmp_path / "from-file"  # a tokenizer.json file: the files beside it come too
    assert consolidate([str(runs["gpt2"]), str(single), "--hf", "--tokenizer", str(tok / "tokenizer.json")]) == 0
    assert (single / "tokenizer_config.json").is_file()


def test_it_streams_one_shard_at_a_time(runs, tmp_path, monkeypatch):
    """At every read, the tensors still alive (the shard being built) fit in one shard; the rest were freed.
    Slices of 1000 elements: the Conv1D weights are written through partial rows of their transposed view."""
    import weakref
    monkeypatch.setattr(hf_export, "CHUNK", 1000)
    read, alive, peaks = hf_export.read_tensor, [], []

    def tracked(*args):
        peaks.append(sum(n for ref, n in alive if ref() is not None))
        t = read(*args)
        alive.append((weakref.ref(t), t.numel() * t.element_size()))
        return t
    monkeypatch.setattr(hf_export, "read_tensor", tracked)
    out = tmp_path / "out"
    assert consolidate([str(runs["gpt2"]), str(out), "--hf", "--max-shard-size", "150KB"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 5 and 0 < max(peaks) <= 150_000
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    masters = consolidated(runs["gpt2"])
    with safe_open(str(out / weight_map["transformer.h.1.mlp.c_fc.weight"]), framework="pt") as f:
        assert torch.equal(f.get_tensor("transformer.h.1.mlp.c_fc.weight"), masters["h.1.mlp.c_fc.weight"].t())


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1.5GiB", 3 * 2**29),
                                        ("200KiB", 200 * 1024), ("10kb", 1250), ("5Gb", 625 * 10**6),
                                        ("1000000", 10**6), (" 2 MiB ", 2 * 2**20), ("1.5 GiBs", None), ("GB", None),
                                        ("-5GB", None), ("5 PB", None), ("", None)])
def test_shard_sizes_read_as_hugging_face_reads_them(text, size):
    """"b": bits, as in transformers' convert_file_size_to_int; fractions too, which it does not read."""
    if size is None:
        with pytest.raises(ExportError, match="--max-shard-size"):
            parse_size(text)
    else:
        assert parse_size(text) == size


def flip_a_byte(run: Path) -> None:
    shard = run / "checkpoints" / "step-00000001" / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))


def truncate_an_old_checkpoint(run: Path) -> None:
    """A checkpoint from before checksums, whose rank 1 file lost its tail: found only while writing."""
    step = run / "checkpoints" / "step-00000001"
    manifest = json.loads((step / "manifest.json").read_text())
    (step / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "sha256"}))
    shard = step / "rank-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4096])


def record_model(extra: dict):
    """A damage: the manifest's extra (the trainer's {"model": spec, "seed"}) replaced by `extra`."""
    def damage(run: Path) -> None:
        path = run / "checkpoints" / "step-00000001" / "manifest.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "extra": extra}))
    return damage


@pytest.mark.parametrize("args, damage, message", [
    (["--max-shard-size", "5XB"], None, "--max-shard-size '5XB' is not a size like 5GB"),
    (["--max-shard-size", "0"], None, "less than one byte"),
    (["--dtype", "int8"], None, "--dtype 'int8' is not one of fp32, bf16, fp16"),
    (["--model", "gpt3-tiny"], None, "cannot build model gpt3-tiny: unknown model"),
    (["--model", "gpt2-small"], None, "does not hold model gpt2-small (not in the checkpoint: "),
    (["--model", "{tmp}"], None, "has no config.json"),
    (["--tokenizer", "{tmp}/none"], None, "no tokenizer at"),
    ([], record_model({}), "does not record its model: pass --model"),
    ([], record_model({"model": "/moved/config.json"}),
     "config.json: No such file or directory (the spec the checkpoint records; pass --model)"),
    ([], flip_a_byte, "rank-00001.safetensors does not match the checksum"),
    ([], truncate_an_old_checkpoint, "is corrupt"),
])
def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, capsys, args, damage, message):
    run = tmp_path / "run"
    shutil.copytree(runs["gpt2"], run)
    if damage:
        damage(run)
    before = sorted(tmp_path.iterdir())
    argv = [str(run), str(tmp_path / "out"), "--hf", *[a.format(tmp=tmp_path) for a in args]]
    assert consolidate(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    left = set(tmp_path.iterdir()) - set(before)
    assert not left, f"left behind: {left}"  # no OUT_DIR, no partial directory (even where it failed writing)


def test_model_names_the_model_the_checkpoint_does_not(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["gpt2"], run)
    record_model({})(run)
    assert consolidate([str(run), str(tmp_path / "out"), "--hf", "--model", "gpt2-tiny"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]


@pytest.mark.parametrize("argv, message", [
    (["{tmp}", "{tmp}/out", "--hf"], "no checkpoint at"),
    (["{run}", "{tmp}/full", "--hf"], "exists and is not an empty directory"),
    (["{run}", "{tmp}/file/out", "--hf"], "cannot write {tmp}/file/out"),
    (["{run}", "{tmp}/out.safetensors", "--dtype", "bf16"], "--dtype needs --hf"),
    (["{run}"], "the following arguments are required: out"),
])
def test_bad_paths_and_flags_are_one_line(runs, tmp_path, capsys, argv, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    (tmp_path / "file").write_text("a file, not a directory")
    before = sorted(tmp_path.iterdir())
    fill = {"tmp": tmp_path, "run": runs["gpt2"]}
    assert consolidate([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.format(**fill) in err and err.count("\n") == 1, err
    left = set(tmp_path.iterdir()) - set(before)
    assert not left and (tmp_path / "full" / "x").read_text() == "mine", f"left behind: {left}"
