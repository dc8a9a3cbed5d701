"""--compile whole, the output head: the traced step computes the loss chunk by chunk, as the eager head does
(zerofunc/lm_head.py), so no tensor of the step holds every token's logits: a chunk's exist while its loss is
taken, and under checkpointing again in backward, one chunk at a time. Before, the traced head took the
logits whole: for Llama-3-8B at 8,192 tokens a micro-batch that is 4.2 GB of fp32 logits and as much
again for their log-softmax, beyond what the planner plans (the eager step's chunks).

Read from inductor's generated code on 2 gloo ranks, stage 0, with and without checkpointing: every buffer
as wide as the vocabulary has at most one chunk's rows; and the step trains as the eager step does."""
from __future__ import annotations

import re

import pytest
import torch

from tests.bare import OPTIM, in_world
from zerofunc.models import GPTConfig

# a vocabulary 62 times the width: 4 chunks of a micro-batch's 22 tokens (zerofunc.lm_head.chunk_rows)
WIDE = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=1000, block_size=16)
TOKENS = 2 * 11


def _run(compile, checkpointing):
    from zerofunc.comm import DistCommunicator
    from zerofunc.engine import ZeroEngine
    from zerofunc.models import GPT
    from zerofunc.stages import STAGES
    from zerofunc.step import train_step
    with torch.device("meta"):
        model = GPT(WIDE)
    engine = ZeroEngine(model, STAGES[0], DistCommunicator(link=None), OPTIM,
                        init=lambda n, s: model.init_param(n, s, 0), compile=compile, checkpointing=checkpointing)
    g = torch.Generator().manual_seed(engine.comm.rank)
    return [train_step(engine, [[torch.randint(0, WIDE.vocab_size, (2, 11), generator=g) for _ in range(2)]]).item()
            for _ in range(3)]


def _head_buffers():
    from torch._inductor.utils import run_and_get_code

    from tests.test_whole_step import apart
    from zerofunc.recompute import ActivationCheckpointing
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = "inductor"
    out = {}
    for mode in ("none", "full"):
        checkpointing = ActivationCheckpointing(mode) if mode != "none" else ActivationCheckpointing()
        eager = _run(False, checkpointing)
        whole, code = run_and_get_code(_run, "whole", checkpointing)
        rows = [int(m.group(1)) for c in code
                for m in re.finditer(rf"= empty_strided_\w+\(\((\d+), {WIDE.vocab_size}\)", c)]
        out[mode] = apart(eager, whole), rows
    return out


@pytest.mark.slow
def test_the_compiled_head_takes_the_logits_a_chunk_at_a_time():
    """Losses within tests/test_whole_step.py's derived 1e-5 (the same chunks, in the same order as eager's;
    measured: 0.0). Every vocabulary-wide buffer holds at most `chunk_rows` tokens' logits, never the
    micro-batch's 22 (tests/plants.py: compiled_head_takes_the_logits_whole), and there are some, or the
    head's buffers went unread."""
    from zerofunc.lm_head import chunk_rows
    most = chunk_rows(TOKENS, WIDE.vocab_size, WIDE.n_embd)
    assert most < TOKENS, "the model's head has one chunk: the case this test is for is gone"
    for mode, (loss_err, rows) in in_world(2, _head_buffers)[0].items():
        assert loss_err <= 1e-5, f"{mode}: losses differ by {loss_err:.1e}"
        assert rows, f"{mode}: no vocabulary-wide buffer in the generated code"
        assert max(rows) <= most, f"{mode}: a buffer of {max(rows)} tokens' logits, where a chunk is {most}"
