"""Shared helpers for the property-based tests that run on real multi-process gloo groups (hypothesis).

A world is started once per test and runs many cases; hypothesis with
`derandomize=True`, no example database and no shrinking draws the same cases on
every rank.
Each rank computes the same single-process reference itself, and every verdict is
agreed over the group (max of the ranks' errors), so all ranks pass or fail
together instead of deadlocking on a collective one rank never reaches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, Phase, settings, strategies as st

from sim.cost import Link
from zerofunc.models import GPTConfig, LlamaConfig, ModelConfig, build_model

# No shrinking: every shrink step re-runs a case on all ranks, which made one failing
# run take minutes; the drawn cases are small enough to read unshrunk.
IN_RANK = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                   suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])

IN_WORLD_EXAMPLES = 6  # cases per world under hypothesis' own profiles, whose 100 are meant for cheap tests


def examples_in_world() -> int:
    """How many cases each world of an in-world property test draws: the max_examples of the suite's
    active profile (tests/conftest.py: fast 2, full 40), else IN_WORLD_EXAMPLES. Read in the launching
    process and passed to the ranks, which do not load the profile."""
    name = settings.get_current_profile_name().split("-with-")[0]  # the pytest plugin's -with-verbosity copies
    return settings.get_profile(name).max_examples if name in ("fast", "full") else IN_WORLD_EXAMPLES


# The rules a communicator may choose its collectives by: a gloo run's own (the cpu-gloo profile's
# rates), the ZeRO paper's ops throughout, rates under which every collective is an all-reduce,
# and rates under which every all-gather is done by broadcasts.
COLLECTIVE_RULES = {"gloo's rates": "backend", "paper": None,
                    "all-reduce": Link(0.0, 1.0, {"all_reduce": float("inf")}),
                    "broadcast": Link(0.0, 1.0, {"broadcast": float("inf")})}


@dataclass(frozen=True)
class Case:
    cfg: ModelConfig
    seed: int
    micro_batch: int
    seq: int


@st.composite
def small_cases(draw, families=("gpt2", "llama")) -> Case:
    """Small GPTs and Llamas of odd widths that rarely divide the world size, 1-3 blocks.

    GPT widths start at 3: a LayerNorm over 1 or 2 features has a constant or +-1
    output, so no gradient flows through it and "gradients are nonzero" could not hold.
    Llamas draw grouped-query attention (1-3 query heads per key/value head, head
    counts of 1-6 that rarely divide the world size), an odd MLP width, a tied or
    untied head, and Qwen2's q/k/v biases; RoPE needs an even head size.
    """
    seq = draw(st.integers(2, 9))
    context = seq + draw(st.integers(0, 3))
    vocab = draw(st.integers(5, 120))  # above 16 widths, the head works in several chunks
    if draw(st.sampled_from(families)) == "gpt2":
        n_head = draw(st.integers(1, 3))
        cfg = GPTConfig(n_layer=draw(st.integers(1, 3)), n_head=n_head, n_embd=n_head * draw(st.sampled_from([3, 5, 7])),
                        vocab_size=vocab, block_size=context, dropout=draw(st.sampled_from([0.0, 0.25])))
    else:
        n_kv_head = draw(st.integers(1, 2))
        n_head = n_kv_head * draw(st.integers(1, 3))
        cfg = LlamaConfig(n_layer=draw(st.integers(1, 3)), n_head=n_head, n_kv_head=n_kv_head,
                          n_embd=n_head * draw(st.sampled_from([2, 4, 6])),
                          intermediate_size=draw(st.sampled_from([5, 11, 17])), vocab_size=vocab, block_size=context,
                          tie_word_embeddings=draw(st.booleans()), qkv_bias=draw(st.booleans()))
    return Case(cfg, seed=draw(st.integers(0, 2**16)), micro_batch=draw(st.integers(1, 3)), seq=seq)


def reference_model(case: Case):
    """The plain single-device model with the same initial weights the engine starts from."""
    model = build_model(case.cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(model.init_param(name, tuple(p.shape), case.seed))
    return model


def global_batches(case: Case, world_size: int, steps: int):
    """Per step (inputs, targets, sample ids) of the whole global batch."""
    gen = torch.Generator().manual_seed(case.seed)
    size = case.micro_batch * world_size
    rows = [torch.randint(0, case.cfg.vocab_size, (size, case.seq + 1), generator=gen) for _ in range(steps)]
    return [(r[:, :-1], r[:, 1:], torch.arange(size) + step * size) for step, r in enumerate(rows)]
