"""The output head as one op: chunked linear + cross-entropy, with and without recomputation,
and the tied embedding, against plain PyTorch computed in float64 in the same test."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofunc.lm_head import (COLUMN_ALIGNMENT, IGNORE_INDEX, LinearCrossEntropy, chunk_columns, chunk_count,
                              chunk_rows, tied_embedding)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@st.composite
def heads(draw):
    """Token counts that rarely divide the chunk size, vocabularies up to 7 chunks wide, some ignored targets."""
    hidden = draw(st.integers(1, 6))
    vocab = draw(st.integers(2, 16 * hidden * 7))
    tokens = draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    ignored = torch.rand(tokens, generator=gen) < draw(st.sampled_from([0.0, 0.3]))
    if ignored.all():
        ignored[0] = False
    t[ignored] = IGNORE_INDEX
    return h, w, t, draw(st.floats(0.25, 4.0))


def grads(loss_fn, h, w, scale):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn(h, w)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@SETTINGS
@given(heads(), st.booleans(), st.one_of(st.none(), st.floats(0.25, 64.0)))
def test_loss_and_gradients_equal_torch_cross_entropy(head, recompute, num_items):
    """The token mean, or with num_items_in_batch (Hugging Face's convention) the summed loss / it."""
    h, w, t, scale = head
    op = LinearCrossEntropy()
    op.recompute = recompute
    n = None if num_items is None else torch.tensor(num_items, dtype=torch.float32)
    ours = grads(lambda h, w: op(h.float(), w.float(), t, n), h, w, scale)

    def ref_loss(h, w):
        if n is None:
            return F.cross_entropy(F.linear(h, w), t, ignore_index=IGNORE_INDEX)
        return F.cross_entropy(F.linear(h, w), t, ignore_index=IGNORE_INDEX, reduction="sum") / n.double()

    ref = grads(ref_loss, h, w, scale)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation takes the same loss
        torch.testing.assert_close(op(h.float(), w.float(), t, n), ours[0], rtol=0, atol=0)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_normalizer_given_makes_no_target_counted_a_zero_loss(recompute):
    """Every target ignored: its own count would give 0 / 0; a normalizer from elsewhere (the global
    batch's) gives a loss of 0 and zero gradients, in training and in evaluation."""
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 3, generator=gen), torch.randn(40, 3, generator=gen)
    t = torch.full((5,), IGNORE_INDEX)
    op = LinearCrossEntropy()
    op.recompute = recompute
    loss, gh, gw = grads(lambda h, w: op(h, w, t, torch.tensor(0.5)), h, w, 1.0)
    assert loss.item() == 0.0 and not gh.any() and not gw.any()
    with torch.no_grad():
        assert op(h, w, t, 0.5).item() == 0.0
    assert op(h, w, t).isnan()  # the token mean of no token


@SETTINGS
@given(heads())
def test_recomputing_the_head_is_bit_for_bit_keeping_it(head):
    h, w, t, scale = head
    runs = []
    for recompute in (False, True):
        op = LinearCrossEntropy()
        op.recompute = recompute
        runs.append(grads(lambda h, w: op(h.float(), w.float(), t), h, w, scale))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens,vocab,hidden,chunks", [(1024, 50257, 768, 5), (7, 100, 4, 2), (3, 10, 4, 1),
                                                         (5, 1000, 1, 5)])
def test_the_vocabulary_sets_the_chunk_count(tokens, vocab, hidden, chunks):
    rows = chunk_rows(tokens, vocab, hidden)
    assert -(-tokens // rows) == chunks


@pytest.mark.parametrize("vocab,hidden", [(50304, 768), (50257, 768), (128256, 4096), (32000, 512), (1000, 16),
                                          (256, 640), (100, 4), (10, 4)])
def test_the_compiled_head_cuts_the_vocabulary_into_aligned_chunks(vocab, hidden):
    """Every chunk of the compiled head but the last is a multiple of 64 entries (gpt2-small cut evenly would be
    10,061: tests/plants.py, compiled_head_chunks_unaligned), no chunk is empty, and there are no more chunks
    than the eager head cuts the tokens into."""
    cols = chunk_columns(vocab, hidden)
    sizes = [min(cols, vocab - first) for first in range(0, vocab, cols)]
    assert all(size % COLUMN_ALIGNMENT == 0 for size in sizes[:-1]), sizes
    assert min(sizes) > 0 and len(sizes) <= chunk_count(vocab, hidden), sizes


@SETTINGS
@given(heads(), st.booleans())
def test_a_tied_embedding_gets_both_gradients(head, use_head):
    h, w, t, scale = head
    idx = t.clamp(min=0).view(-1, 1)[: max(1, len(t) // 2)]

    def loss_fn(tied):
        def run(h, w):
            x, head_w = tied(idx, w)
            out = (x.sin() * h[: len(idx)].unsqueeze(1)).sum()
            return out + F.linear(h, head_w).square().mean() if use_head else out
        return run

    ours = grads(loss_fn(tied_embedding), h, w, scale)
    ref = grads(loss_fn(lambda idx, w: (F.embedding(idx, w), w)), h, w, scale)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
