"""Hugging Face's GPT2LMHeadModel (tied head, its own ModuleList of blocks) and LlamaForCausalLM (grouped-query
attention, untied head, odd widths) train through zerofunc.initialize exactly like one device. Their labels carry
ignored positions (-100) that count differently on each rank and micro-step, and one global batch counts none:
the loss is the global batch's token mean, which reaches their loss through `num_items_in_batch`. Seven more
families, whose blocks and glue differ from these two (tests/hf_families.py), train like one device at stage 3.
Runs where transformers is installed (the test extras install it)."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.bare import in_world
from tests.hf_families import LLAMA_LIKE, OTHER_FAMILIES
from tests.steps import check_steps, ignore_some, record_step

transformers = pytest.importorskip("transformers")


def hf_model(family: str, attention: str = "sdpa"):
    """A small random model of `family`: GPT-2's or Llama's with the `attention` asked, or one of
    tests/hf_families.py's with its own."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    built_elsewhere = {**OTHER_FAMILIES, **LLAMA_LIKE}
    if family in built_elsewhere:
        return built_elsewhere[family]()
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=3, n_embd=27, vocab_size=53, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0, attn_implementation=attention))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=30, intermediate_size=41,
                                        num_attention_heads=3, num_key_value_heads=1, vocab_size=53,
                                        max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                        attn_implementation=attention))


def hf_four_lines(stage: int, family: str, checkpointing: str = "none", attention: str = "sdpa"):
    import zerofunc

    torch.manual_seed(0)
    model = hf_model(family, attention)
    reference = copy.deepcopy(model)  # trained without checkpointing: the same gradients, bit for bit
    ac = {"activation_checkpointing": {"mode": checkpointing}} if checkpointing not in ("none", "own") else {}
    if checkpointing == "own":  # the model's own, as a Trainer's gradient_checkpointing=True turns it on
        model.gradient_checkpointing_enable()
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                         "zero_optimization": {"stage": stage}, **ac,
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                                                   "eps": 1e-5, "weight_decay": 0.1}}})
    rank, world = engine.comm.rank, engine.comm.world_size
    gen = torch.Generator().manual_seed(1)
    steps = []
    for i in range(3):
        ids = torch.randint(0, 53, (2 * world, 11), generator=gen)
        labels = ignore_some(ids, gen) if i != 1 else torch.full_like(ids, -100)  # step 2 counts no label
        everyone = [{"input_ids": ids[j:j + 1], "labels": labels[j:j + 1]} for j in range(2 * world)]
        steps.append(record_step(engine, everyone[rank::world], everyone))  # micro-step j of rank r: j*N + r
    check_steps(reference, steps, f"{family} stage {stage} checkpointing {checkpointing}")
    assert steps[1].loss == 0.0, f"{family} stage {stage}: a global batch of no counted label lost {steps[1].loss}"
    if checkpointing == "own":  # the engine recomputed each block, and left the model's own setting as it was
        assert engine.checkpointing.mode == "full" and model.is_gradient_checkpointing, f"{family} stage {stage}"
    return [u.name for u in engine.units]


def stages_0_and_3(family: str, checkpointing: str = "none", attention: str = "sdpa"):
    return [hf_four_lines(stage, family, checkpointing, attention) for stage in (0, 3)]


def both_families() -> dict:
    return {family: stages_0_and_3(family) for family in ("gpt2", "llama")}


@pytest.fixture(scope="module")
def hf_world() -> list[dict]:
    """One 2-gloo-rank world (and one transformers import) for both families: per rank, {family: per stage
    the units}."""
    return in_world(2, both_families)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family, blocks", [("gpt2", "transformer.h"), ("llama", "model.layers")])
def test_hugging_face_models_train_like_one_device(request, family, blocks, ranks):
    """On 2 gloo ranks, and on one."""
    if ranks == 1:
        results = in_world(1, stages_0_and_3, family)
    else:
        results = [per_rank[family] for per_rank in request.getfixturevalue("hf_world")]
    for rank_results in results:
        for stage, units in zip((0, 3), rank_results):  # each step one device's within fp32 rounding
            assert units == ["", f"{blocks}.0", f"{blocks}.1"], f"stage {stage}"


def other_families() -> dict:
    return {(family, checkpointing): hf_four_lines(3, family, checkpointing)
            for family in OTHER_FAMILIES for checkpointing in ("none", "full")}


@pytest.mark.slow
def test_other_hugging_face_families_train_like_one_device():
    """Any Hugging Face causal LM, not the two above only: each of OTHER_FAMILIES at stage 3 (each block
    gathered, released, and its gradient reduce-scattered, around the model's own glue), on 2 gloo ranks in
    one world, every step one device's (tests/steps.py); and checkpointed, against the model trained without.
    BLOOM, Falcon and GPT-NeoX hand their layers the cache as `layer_past`, OPT as `cache`: a checkpointed
    layer must get none whatever its name (zerofunc/recompute.py, `without_cache`)."""
    for per_rank in in_world(2, other_families):
        for (family, checkpointing), units in per_rank.items():
            assert len(units) == 3, f"{family}, checkpointing {checkpointing}: units {units}, not the root and two blocks"


@pytest.mark.parametrize("checkpointing", ["full", "selective-op", "own"])
@pytest.mark.parametrize("family, attention", [("gpt2", "eager"), ("llama", "sdpa")])
def test_hugging_face_models_checkpointed_train_like_one_device(family, attention, checkpointing):
    """Checkpointed Hugging Face layers, against the model trained without checkpointing. Their forward
    appends its keys and values to the model's cache: run again in backward against it, a layer would attend
    to them twice (GPT-2's eager attention: other gradients), or run ops its forward did not (SDPA's, under
    selective-op: torch refuses). The engine passes a checkpointed layer no cache, as Hugging Face does.
    "own": the model's own checkpointing, `gradient_checkpointing_enable()`, whose recomputation in backward
    would run outside the engine's forward, on the module's released weights (a meta tensor: it failed), and
    whose checkpoint inside the engine's would checkpoint the recomputation again: the engine recomputes each
    block itself instead, with the model's own off while it steps, and on again after."""
    for stage, units in zip((0, 3), in_world(1, stages_0_and_3, family, checkpointing, attention)[0]):
        assert len(units) == 3, f"stage {stage}: {units}"
