"""Identical blocks simulated once (zerofunc.plan.folding): a step folded from short runs is the whole step's,
the memory and the collectives to the byte, the times within rounding."""
from __future__ import annotations

import pytest
import torch.nn as nn
import torch.nn.functional as F

from zerofunc.plan import Plan, simulate


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Mixed(nn.Module):
    """23 blocks of one shape, one of another (a wider hidden layer), 22 of the first again: three runs."""

    def __init__(self, vocab: int = 96, width: int = 24, runs: tuple[int, ...] = (23, 1, 22)):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, 72 if i % 2 else 40) for i, n in enumerate(runs) for _ in range(n))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def mixed() -> nn.Module:
    return Mixed()


def _same(whole, folded):
    assert folded.folded and not whole.folded
    assert folded.memory == whole.memory  # every category's maximum, the peak and what made it, to the byte
    assert folded.ledger == whole.ledger and folded.numel == whole.numel and folded.flops == whole.flops
    # seconds: the same sums added in another order, ~1e-16 of the total each
    for a, b in ((folded.compute_s, whole.compute_s), (folded.step_s, whole.step_s),
                 (folded.exposed_comm_s, whole.exposed_comm_s), *zip(folded.offload_s.values(), whole.offload_s.values())):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("stage, levers", [
    (0, {}), (1, {"activation_checkpointing": "full"}), (2, {"offload_optimizer": True}),
    (3, {}), (3, {"activation_checkpointing": "selective", "ac_every": 2}), (3, {"shard_group": 2, "hpz": None}),
    (3, {"activation_checkpointing": "selective-op", "grad_accum": 2}),
])
@pytest.mark.parametrize("hardware", ["h100-sxm", "cpu-gloo"])
def test_a_step_folded_from_short_runs_is_the_whole_step(stage, levers, hardware):
    """The blocks here are tiny: with the default bucket (25 MB) every reduction of a step would still be in
    flight at its end, where it is waited for, as a real model's are not (a Llama block's gradients fill a
    bucket each); a one-byte bucket waits for each block's reductions as a real model does."""
    plan = Plan(world_size=4, stage=stage, model=mixed, seq=12, micro_batch=3, hardware=hardware, bucket_bytes=1,
                **levers)
    _same(simulate(plan, fold=False, timeline=True), simulate(plan, timeline=True))


def test_a_step_that_does_not_fold_is_simulated_whole():
    """The tiny blocks with the default bucket: the waits at the step's end refer further back with each block,
    which the fold does not extend; the check refuses it and the step is simulated whole."""
    plan = Plan(world_size=4, stage=3, model=mixed, seq=12, micro_batch=3, hardware="h100-sxm")
    folded, whole = simulate(plan), simulate(plan, fold=False)
    assert not folded.folded and folded.memory == whole.memory and folded.ledger == whole.ledger


@pytest.mark.parametrize("timing", [False, True])
def test_a_run_is_cut_past_the_blocks_whose_reductions_stay_in_flight(timing):
    """A 16 KiB bucket holds about four of these blocks' gradients (2,008 parameters, bf16): the first blocks'
    reductions are never waited for in the step's middle, and only from the fifth on does a block add a
    wait. Cut to fewer blocks, the short runs show no waits and a memory that only grows, and the fold
    (checked on its own short runs) would extend that to the whole run."""
    plan = Plan(world_size=4, stage=3, model=lambda: Mixed(runs=(40,)), seq=12, micro_batch=3, hardware="h100-sxm",
                bucket_bytes=16384)
    whole, folded = simulate(plan, fold=False, timeline=True, timing=timing), simulate(plan, timeline=True,
                                                                                        timing=timing)
    _same(whole, folded)


def test_llama_70b_is_folded_to_the_byte():
    plan = Plan(world_size=64, stage=3, model="llama3-70b", seq=4096, hardware="h100-sxm")
    _same(simulate(plan, fold=False), simulate(plan))


def test_runs_too_short_to_gain_are_simulated_whole():
    plan = Plan(world_size=2, stage=3, model="gpt2-tiny", seq=64)
    assert not simulate(plan).folded


def hf_llama():
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=24,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_hugging_face_model_folds_to_the_byte(stage):
    """Hugging Face's Llama slices its layers by its config's count, and numbers them (`layer_idx`): a copy cut
    short still runs, and its blocks count as identical."""
    plan = Plan(world_size=4, stage=stage, model=hf_llama, seq=64, micro_batch=2, hardware="h100-sxm", bucket_bytes=1)
    _same(simulate(plan, fold=False), simulate(plan))
