"""--compile whole, the output head: the traced step computes the loss in as many chunks as the eager head
(zerofunc/lm_head.py), cut along the vocabulary, so no tensor of the step holds every token's logits over the
whole vocabulary, and the weight's gradient is written chunk by chunk into its own rows. Before, the traced
head took the logits whole (for Llama-3-8B at 8,192 tokens a micro-batch, 4.2 GB of fp32 logits and as much
again for their log-softmax, beyond what the planner plans); then in the eager head's chunks of tokens, where
the weight's gradient was a sum of one vocabulary-by-width product per chunk, two of them alive at once in the
compiled backward (it cannot accumulate in place): for gpt2-small 74 MiB more at the step's peak. And the
token embedding's gradient, tied to the head or not, is taken in the weight's dtype, as eager takes it.

Read from inductor's generated code on 2 gloo ranks, stage 0, with and without checkpointing: what each
matmul writes; and the step trains as the eager step does."""
from __future__ import annotations

import re

import pytest
import torch

from tests.bare import OPTIM, in_world
from zerofunc.models import GPTConfig
from zerofunc.models.llama import LlamaConfig

# a vocabulary 62 times the width: 4 chunks (zerofunc.lm_head.chunk_count), of 256 entries but the last, 22 tokens
WIDE = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=1000, block_size=16)
TOKENS = 2 * 11


def _run(compile, checkpointing, precision="fp32", make=None):
    from zerofunc.comm import DistCommunicator
    from zerofunc.engine import ZeroEngine
    from zerofunc.models import GPT
    from zerofunc.stages import STAGES
    from zerofunc.step import train_step
    with torch.device("meta"):
        model = GPT(WIDE) if make is None else make()
    engine = ZeroEngine(model, STAGES[0], DistCommunicator(link=None), OPTIM,
                        init=lambda n, s: model.init_param(n, s, 0), compile=compile, checkpointing=checkpointing,
                        precision=precision)
    g = torch.Generator().manual_seed(engine.comm.rank)
    return [train_step(engine, [[torch.randint(0, WIDE.vocab_size, (2, 11), generator=g) for _ in range(2)]]).item()
            for _ in range(3)]


def products(code: str) -> list[tuple[int, ...]]:
    """The shape of what each matmul of inductor's generated `code` writes (its `out=` buffer, followed through
    inductor's reuses and views)."""
    shapes: dict[str, tuple[int, ...]] = {}
    dims = lambda text: tuple(int(x) for x in text.split(",") if x.strip())  # noqa: E731
    for line in code.splitlines():
        if m := re.search(r"(buf\d+) = empty_strided_\w+\(\(([\d, ]+)\)", line):
            shapes[m[1]] = dims(m[2])
        elif m := re.search(r"(buf\d+) = reinterpret_tensor\(\w+, \(([\d, ]+)\)", line):
            shapes[m[1]] = dims(m[2])
        elif m := re.search(r"(buf\d+) = (buf\d+); del \2  # reuse", line):
            shapes[m[1]] = shapes.get(m[2])
    return [shapes.get(m[1]) for m in re.finditer(r"extern_kernels\.(?:mm|addmm)\([^\n]*out=(buf\d+)\)", code)]


def _head_products():
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
        out[mode] = apart(eager, whole), [p for c in code for p in products(c)]
    return out


@pytest.mark.slow
def test_the_compiled_head_takes_the_logits_a_chunk_at_a_time():
    """Losses within tests/test_whole_step.py's derived 1e-5 (the same sums, the logsumexp taken over the
    chunks' logsumexps; measured: 0.0). No matmul writes logits over the whole vocabulary
    (tests/plants.py: compiled_head_takes_the_logits_whole) nor a vocabulary-by-width product
    (compiled_head_cuts_the_tokens), and some write one chunk's logits for every token, or the head went unread."""
    from zerofunc.lm_head import chunk_columns
    cols = chunk_columns(WIDE.vocab_size, WIDE.n_embd)
    assert cols < WIDE.vocab_size, "the model's head has one chunk: the case this test is for is gone"
    for mode, (loss_err, made) in in_world(2, _head_products)[0].items():
        assert loss_err <= 1e-5, f"{mode}: losses differ by {loss_err:.1e}"
        assert (TOKENS, cols) in made, f"{mode}: no matmul makes a chunk's logits ({TOKENS}, {cols}): {made}"
        whole = [p for p in made if p is not None and len(p) == 2 and WIDE.vocab_size in (p[1], p[0])
                 and p != (WIDE.vocab_size, WIDE.n_embd)]
        assert not whole, f"{mode}: matmuls write logits over the whole vocabulary: {whole}"
        summed = made.count((WIDE.vocab_size, WIDE.n_embd))
        assert not summed, f"{mode}: {summed} matmuls write the whole weight's gradient, a sum over chunks"


# untied: the embedding is an nn.Embedding (Hugging Face's, ours for Llama), the head a weight of its own
UNTIED = LlamaConfig(n_layer=2, n_head=2, n_embd=16, intermediate_size=32, vocab_size=1000, block_size=16)


def _bf16_buffers():
    """Every buffer inductor's generated code allocates, (shape, dtype), in a bf16 step of the tied GPT and of the
    untied Llama."""
    from torch._inductor.utils import run_and_get_code

    from zerofunc.models.llama import Llama
    from zerofunc.recompute import ActivationCheckpointing
    from zerofunc.whole_step import WholeStep
    WholeStep.backend = "inductor"
    out = {}
    for name, model in (("tied", None), ("untied", lambda: Llama(UNTIED))):
        _, code = run_and_get_code(_run, "whole", ActivationCheckpointing(), "bf16", model)
        out[name] = [(m[1], m[2]) for c in code
                     for m in re.finditer(r"= empty_strided_\w+\(\(([\d, ]+)\), \([\d, ]*\), torch\.(\w+)\)", c)]
    return out


@pytest.mark.slow
def test_the_compiled_embeddings_take_their_gradient_in_the_weight_s_dtype():
    """bf16 weights: the token embedding adds its rows into the weight's gradient in bf16, as the eager step's
    embeddings do: tied to the head (GPT, zerofunc/lm_head.py) or not (Llama's nn.Embedding), its backward is
    ATen's kernel, the eager one (zerofunc/decompositions.py). Through torch's decomposition of F.embedding's
    backward, the gradient was a vocabulary-by-width fp32 buffer, rounded to bf16: tied at gpt2-small 147 MiB at
    the end of backward, where stages 1-2 then peaked; untied at Llama-3-8B 2.1 GB (tests/plants.py:
    compiled_embedding_in_fp32). And the weight's gradient is read at all: some buffer of its shape in bf16."""
    wide = {"1000, 16", "16000, "}
    wrong = []
    for name, buffers in in_world(2, _bf16_buffers)[0].items():
        if not any(shape in wide and dtype == "bfloat16" for shape, dtype in buffers):
            wrong.append(f"{name}: the weight's gradient went unread")
        if fp32 := [shape for shape, dtype in buffers if shape in wide and dtype == "float32"]:
            wrong.append(f"{name}: {len(fp32)} vocabulary-by-width fp32 buffers in the bf16 step")
    assert not wrong, "; ".join(wrong)
