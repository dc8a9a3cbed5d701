"""The planner plans any nn.Module, and a Llama: planned against trained on 2 gloo ranks, every stage.

zerofunc's llama-tiny, Hugging Face's LlamaForCausalLM (tiny config, GQA, widths
that do not divide the world size), T5, BART, T5Gemma, Whisper and CLIP (two stacks of blocks each,
tests/hf_families.py; BART and T5Gemma read a value of the batch in their forward, Whisper and CLIP take
features and images, the plan's own `batch`) each run one real training step through
`zerofunc.initialize`, watched by the planner's own memory tracker, beside
`simulate()` of the same plan: the communication must be equal to the byte (the whole
ledger, entry by entry) and the peak within 5%.
"""
from __future__ import annotations

import pytest
import torch

from sim.memory import MemoryTracker
from tests.bare import in_world
from zerofunc.api import initialize
from zerofunc.comm import DistCommunicator
from zerofunc.plan import Plan, simulate
from zerofunc.step import train_step

MICRO_BATCH, SEQ = 2, 13


def tiny_hf_llama():
    """Hugging Face's Llama from a config: 6 query heads sharing 2 key/value heads, odd widths."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=60, intermediate_size=91,
                                        num_attention_heads=6, num_key_value_heads=2, vocab_size=97,
                                        max_position_embeddings=64, attn_implementation="sdpa"))


def two_stacks(name: str):
    def build():
        from tests.hf_families import TWO_STACKS
        return TWO_STACKS[name][0]()
    return build


def whisper_batch(micro_batch: int, seq: int) -> dict:
    """Whisper's micro-batch: log-mel features (8 bins, 32 frames: tests/hf_families.py's config) and labels."""
    gen = torch.Generator().manual_seed(micro_batch * 1000 + seq)
    return {"input_features": torch.randn(micro_batch, 8, 32, generator=gen),
            "labels": torch.randint(1, 53, (micro_batch, seq), generator=gen)}


def clip_batch(micro_batch: int, seq: int) -> dict:
    """CLIP's micro-batch: captions and 16 x 16 images, and its contrastive loss asked for."""
    gen = torch.Generator().manual_seed(micro_batch * 1000 + seq)
    return {"input_ids": torch.randint(1, 53, (micro_batch, seq), generator=gen),
            "pixel_values": torch.randn(micro_batch, 3, 16, 16, generator=gen), "return_loss": True}


def padded_batch(micro_batch: int, seq: int) -> dict:
    """Llama's micro-batch with its first row padded (its last 3 positions masked, their labels ignored): the
    forward reads that the mask is not all ones, and attends through it."""
    ids = torch.randint(1, 97, (micro_batch, seq), generator=torch.Generator().manual_seed(seq))
    mask = torch.ones(micro_batch, seq, dtype=torch.long)
    mask[0, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# each Hugging Face model's builder, vocabulary, and micro-batch where it takes no token ids and labels, or a padded
# one (the plan's `batch`); BART's and T5Gemma's forward read a value of the batch (whether the padding mask is all
# ones), which the planner takes from the batch it simulates: full rows, no special id, unless `batch` says otherwise
HF = {"hf": (tiny_hf_llama, 97, None), "hf-padded": (tiny_hf_llama, 97, padded_batch),
      "t5": (two_stacks("t5"), 53, None), "bart": (two_stacks("bart"), 53, None),
      "t5gemma": (two_stacks("t5gemma"), 53, None), "whisper": (two_stacks("whisper"), 53, whisper_batch),
      "clip": (two_stacks("clip"), 53, clip_batch)}


def plan_of(model, stage: int, world: int, batch=None) -> Plan:
    return Plan(world_size=world, stage=stage, model=model, precision="fp32", micro_batch=MICRO_BATCH, seq=SEQ,
                hardware="cpu-gloo", batch=batch)


def planned_and_trained(model_name: str, stage: int):
    """(whether the planned ledger is the executed one, planned peak, measured peak, collectives) on this rank."""
    comm = DistCommunicator()
    build, vocab, batch_of = HF.get(model_name, (None, 97, None))
    plan = plan_of(build or model_name, stage, comm.world_size, batch_of)
    sim = simulate(plan)
    tracker = MemoryTracker()
    torch.manual_seed(0)
    model = build() if build else plan.build()  # real weights, or meta and init_param
    engine = initialize(model, plan.zero_config(), device="cpu", comm=comm, memory=tracker, compile=False)
    if batch_of is not None:
        batch = batch_of(MICRO_BATCH, SEQ)
    else:  # from 1: id 0 is tests/hf_families.py's special
        ids = torch.randint(1, vocab, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(comm.rank))
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, :-1].clone()} if build else (ids[:, :-1], ids[:, 1:])
    with tracker:
        train_step(engine, [batch])
    return sim.ledger == comm.ledger.entries, sim.memory.peak, tracker.peak, len(sim.ledger)


def every_stage(model_name: str):
    return [planned_and_trained(model_name, stage) for stage in range(4)]  # one world for all four


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["llama-tiny", "hf", "hf-padded", "t5", "bart", "t5gemma", "whisper", "clip"])
def test_planned_step_is_the_trained_step(model_name):
    if model_name in HF:
        pytest.importorskip("transformers")
    for rank_results in in_world(2, every_stage, model_name):
        for stage, (same_ledger, planned, measured, collectives) in enumerate(rank_results):
            assert same_ledger, f"stage {stage}: the planned collectives differ from the executed ones"
            assert collectives >= 2
            assert abs(planned - measured) / measured <= 0.05, f"stage {stage}: peak {planned} planned, {measured} measured"


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_the_kernel_cache_changes_nothing(model):
    """The planner answers repeated meta kernels from a cache: every event of the step, every collective
    and every FLOP must be what running each kernel gives (sim/meta_cache.py)."""
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            plan = Plan(world_size=3, stage=stage, model=model, precision=precision, micro_batch=2, seq=11)
            cached, plain = (simulate(plan, timeline=True, kernel_cache=c) for c in (True, False))
            assert cached.memory.timeline == plain.memory.timeline
            assert (cached.ledger, cached.flops, cached.compute_s) == (plain.ledger, plain.flops, plain.compute_s)


def test_a_plan_s_batch_is_refused_in_one_line_where_it_cannot_be_fed():
    """`batch=` is a model callable's micro-batch: refused for a preset (whose batch is token ids), and where it
    returns what no forward takes."""
    with pytest.raises(ValueError, match="^batch= is a callable"):
        Plan(world_size=2, stage=0, model="gpt2-tiny", batch=lambda b, s: ())
    with pytest.raises(ValueError, match="^batch= returned int: give a tuple"):
        simulate(Plan(world_size=2, stage=0, model=lambda: torch.nn.Sequential(torch.nn.Embedding(5, 4)), seq=8,
                      batch=lambda b, s: 3))
