"""Pretrained weights in (zerofunc/pretrained.py): each rank reads only its shard's elements, the values
are exactly the files' (GPT-2's Conv1D transposed, tied heads, bf16 widened), the load stays within its
memory bound, and fine-tuning from them trains like one device. The trainer's side: test_init_from.py."""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.torch import load_file, save_file

from tests.bare import in_world
from tests.hf_dirs import FAMILIES, save_hf_dir
from zerofunc import hf_files, pretrained
from zerofunc.models import build_model, model_config

# not importorskip: the ranks import this module, and transformers takes seconds to import
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def meta_model(spec: str):
    with torch.device("meta"):
        return build_model(model_config(spec))


def file_tensors(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name in sorted(set(index.values())):
        out.update(load_file(path / name))
    return out


def expected(source, model, tensors) -> dict[str, torch.Tensor]:
    """Each parameter as the files hold it, in our layout (Conv1D weights transposed)."""
    names = source.names
    return {n: tensors[names.key(n)].t() if names.transposed(n) else tensors[names.key(n)]
            for n, _ in model.named_parameters()}


# ---- the range reader, against the whole tensor ------------------------------------------------------

@pytest.fixture(scope="module")
def one_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "w.safetensors"
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 13, generator=gen), "b": torch.randn(3, 4, 5, generator=gen),
               "c": torch.randn(11, generator=gen), "d": torch.randn(13, 7, generator=gen).bfloat16()}
    save_file(tensors, str(path))
    return path, tensors


@given(name=st.sampled_from(["a", "b", "c", "d", "a^T"]), data=st.data())
def test_a_range_read_is_the_flattened_tensors_range(one_file, name, data):
    """Any [lo, hi) of any tensor, read straight or transposed, is exactly that range of the whole
    (planted: a part row cut one element late fails here)."""
    path, tensors = one_file
    key, transposed = name.rstrip("^T"), name.endswith("^T")
    whole = tensors[key].t() if transposed else tensors[key]
    n = whole.numel()
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    out = torch.full((hi - lo,), float("nan"))
    with pretrained.open_safetensors(path) as h:
        hf_files.read_range(h, key, tuple(whole.shape), lo, hi, transposed, out, pretrained.NoMemoryTracking())
    assert torch.equal(out, whole.reshape(-1)[lo:hi].float())


# ---- whole loads, in a world where tensors straddle shard boundaries ----------------------------------

def load_every_family(dirs: dict, stage: int) -> dict:
    import zerofunc

    out = {}
    for family, path in dirs.items():
        model = meta_model(str(path / "config.json"))
        source = pretrained.weights(path, model)
        engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                                             "bf16": {"enabled": family == "qwen2"}}, init=source)
        want = expected(source, model, file_tensors(path))
        full = engine.full_parameters()
        assert full.keys() == want.keys(), family
        out[family] = {n: torch.equal(full[n], want[n].float()) for n in full}
    return out


@pytest.mark.slow
def test_three_ranks_load_exactly_the_files_values(tmp_path):
    """Llama (untied, GQA), Qwen2 (tied, biases; a bf16 file into fp32 masters and bf16 weights), GPT-2
    (Conv1D, prefixed keys), at stage 3 on 3 ranks: every master equals the file's value, widened
    exactly (planted: skipping the Conv1D transpose fails on transformer.h.0.attn.c_attn.weight's
    shape check; reading a shard from the wrong rows fails here)."""
    dirs = {f: save_hf_dir(f, tmp_path / f, dtype=torch.bfloat16 if f == "qwen2" else torch.float32)
            for f in FAMILIES}
    for per_rank in in_world(3, load_every_family, dirs, 3):
        for family, equal in per_rank.items():
            assert all(equal.values()), f"{family}: {[n for n, ok in equal.items() if not ok]}"


def load_with_tracker(path, stage: int) -> dict:
    """Load on this rank under the memory tracker: its peak, what stays live, and the largest slice a
    range read takes from the files (whole rows, or a Conv1D weight's whole columns)."""
    import zerofunc
    from sim.memory import MemoryTracker

    model = meta_model(str(path / "config.json"))
    source = pretrained.weights(path, model)
    tracker = MemoryTracker()
    with tracker:
        engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 1,
                                             "zero_optimization": {"stage": stage}}, init=source, memory=tracker)
    rank = engine.comm.rank
    largest = 0
    for unit in engine.units:
        for slot, lo, hi, _ in unit.layout.pieces(*unit.layout.shard_range(rank)):
            width = math.prod(slot.shape[1:])  # our rows; a transposed weight's are the file's columns
            rows = math.ceil(hi / width) - lo // width
            largest = max(largest, rows * width * 4)  # fp32 files
    report = tracker.report()
    return {"peak": tracker.peak, "end": sum(tracker.live.values()), "largest_slice": largest,
            "in_flight": report.max_by_category["other"], "params": tracker.live["params"],
            "whole_model": sum(u.layout.numel for u in engine.units) * 4}


def load_both_with_tracker(dirs: dict, stage: int) -> dict:
    return {family: load_with_tracker(path, stage) for family, path in dirs.items()}


def test_a_rank_loading_holds_its_shard_plus_one_slice(tmp_path):
    """Stage 3 on 2 ranks, through the memory tracker: each rank's peak while loading is at most what
    it keeps (its shard of the weights and AdamW's moments) plus the largest single slice it reads,
    and what is read is never more than that slice at a time. Tied models, so that each rank's shard
    ends or starts inside the embedding. Reading whole tensors instead (planted: materialize calling
    init(name, shape) and cutting) holds a whole embedding in flight, twice the bound."""
    dirs = {family: save_hf_dir(family, tmp_path / family, vocab=1000) for family in ("qwen2", "gpt2")}
    for rank in (r for per_rank in in_world(2, load_both_with_tracker, dirs, 3) for r in per_rank.values()):
        assert rank["in_flight"] <= rank["largest_slice"], rank
        assert rank["end"] <= rank["peak"] <= rank["end"] + rank["largest_slice"], rank
        assert rank["params"] < rank["whole_model"] / 2 + rank["largest_slice"], rank  # no rank builds the model


def test_gpt2_files_of_every_vintage_read_alike(tmp_path):
    """The OpenAI-converted files have no `transformer.` prefix and carry the attention-mask buffers;
    a tied file may carry the head too: all read to the same weights, Conv1D transposed."""
    path = save_hf_dir("gpt2", tmp_path / "new")
    model = meta_model(str(path / "config.json"))
    tensors = file_tensors(path)
    want = expected(pretrained.weights(path, model), model, tensors)
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    old |= {"h.0.attn.bias": torch.ones(1, 1, 4, 4), "h.1.attn.masked_bias": torch.tensor(-1e4),
            "lm_head.weight": tensors["transformer.wte.weight"].clone()}
    save_file(old, str(tmp_path / "old.safetensors"))
    source = pretrained.weights(tmp_path / "old.safetensors", model)
    assert source.names.prefix == ""
    for name, w in want.items():
        assert torch.equal(source(name, tuple(w.shape)), w), name


# ---- fine-tuning from loaded weights trains like one device ------------------------------------------

def finetune_steps(dirs: dict) -> int:
    """Per family (Llama: untied, GQA; Qwen2: tied, biases) and stage, two steps of 2 micro-steps from the
    files' weights, with ignored targets drawn, each held to one device's step (tests/steps.py)."""
    import zerofunc
    from tests.steps import check_steps, drawn_steps

    checked = 0
    for family, path in dirs.items():
        spec = str(path / "config.json")
        reference = build_model(model_config(spec))
        for stage in range(4):
            model = meta_model(spec)
            engine = zerofunc.initialize(model, {
                "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": stage},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5,
                                                          "weight_decay": 0.1}}}, init=pretrained.weights(path, model))
            want = expected(pretrained.weights(path, model), model, file_tensors(path))
            steps = drawn_steps(engine, vocab=300, seq=9, seed=7)
            assert all(torch.equal(steps[0].params[n], want[n].float()) for n in want), f"{family} stage {stage}"
            check_steps(reference, steps, f"{family} from its files, stage {stage}")
            checked += 1
    return checked


@pytest.mark.parametrize("world", [1, *(pytest.param(n, marks=pytest.mark.slow) for n in (2, 3, 4))])
def test_finetuning_from_loaded_weights_trains_like_one_device(tmp_path, world):
    """Stages 0-3 on 1-4 ranks, ignored labels drawn: each step within the derived rounding budgets of
    one device's step from the same weights (tests/steps.py), the first from exactly the files' values."""
    dirs = {f: save_hf_dir(f, tmp_path / f) for f in ("llama", "qwen2")}
    assert in_world(world, finetune_steps, dirs) == [8] * world


def hugging_face_model_from_its_files(path) -> tuple[float, float]:
    import transformers

    import zerofunc

    cfg = transformers.AutoConfig.from_pretrained(path)
    with pretrained.parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
                                 init=pretrained.weights(path, model))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        return engine(input_ids=ids, labels=ids).loss.item(), reference(input_ids=ids, labels=ids).loss.item()


@pytest.mark.slow
def test_a_hugging_face_model_on_meta_loads_its_own_files(tmp_path):
    """Through the library: Hugging Face's Qwen2 built with its parameters on meta (its RoPE buffers real),
    filled from its own files at stage 3: the same loss as from_pretrained, bit for bit (the same ops on
    the same weights; planted: building under torch.device('meta') leaves inv_freq without data)."""
    path = save_hf_dir("qwen2", tmp_path / "qwen2")
    ours, theirs = in_world(1, hugging_face_model_from_its_files, path)[0]
    assert ours == theirs
