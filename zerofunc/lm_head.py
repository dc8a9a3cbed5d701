"""A language model's output head: its logits and loss as one op, and an embedding tied to it.

`LinearCrossEntropy`: the last matmul makes one logit per vocabulary entry per token, and
the loss then keeps a log-softmax of the same size: for gpt2-small at 4 x 256 tokens in
fp32 that is 2 x 196 MiB, more than all twelve blocks keep once they are checkpointed.
Here the tokens are cut into chunks; each chunk's logits exist only while its loss and
gradient (softmax minus one-hot, in fp32) are computed, and what backward needs is either:

- that gradient, kept from forward for every chunk (`recompute=False`): the size of one
  fp32 log-softmax and no extra compute, or
- nothing but the head's input (`recompute=True`, set by the engine when activation
  checkpointing is on): backward computes each chunk's logits and gradient again.

Both paths run the same ops on the same operands, so a model trains bit for bit the same
either way. Chunks are as many as the vocabulary is wider than 16 hidden states, so a chunk's
fp32 logits weigh no more than 16 hidden states per token of the batch: about what one
block keeps. Smaller chunks would save little beside the blocks, and each chunk adds into
the vocabulary-sized weight gradient once, so more of them cost memory traffic.
The weight is saved through autograd, so under stage 3 the engine's saved-tensor hooks
gather it again when backward needs it, as they do for any matmul.

`tied_embedding`: a token embedding whose weight is also the head's. Used twice, the weight
would get two vocabulary-sized gradients, the embedding's almost all zeros, and autograd
would add them. Instead the embedding hands the head its weight, receives the head's
gradient in its own backward, and adds its few rows into it.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from zerofunc.tape import overridable

IGNORE_INDEX = -100  # torch's and Hugging Face's: targets equal to it are not counted


def chunk_count(vocab: int, hidden: int) -> int:
    """The vocabulary's width in units of 16 hidden states."""
    return max(1, math.ceil(vocab / (16 * hidden)))


def chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk, the eager head's cut."""
    return max(1, math.ceil(tokens / chunk_count(vocab, hidden)))


# vocabulary entries: the compiled head's chunks are multiples of it, as nanoGPT pads GPT-2's vocabulary to 64
COLUMN_ALIGNMENT = 64


def chunk_columns(vocab: int, hidden: int) -> int:
    """Vocabulary entries per chunk, the compiled head's cut: no more chunks than the eager head's, each a
    multiple of `COLUMN_ALIGNMENT` entries but the last. A chunk's logits are rows of that many entries, which
    a GPU's matmul writes, and backward reads, aligned; cut evenly, gpt2-small's 50,304 entries would make rows
    of 10,061 (20,122 bytes in bf16), which leave cuBLAS its unaligned kernels."""
    cols = math.ceil(vocab / chunk_count(vocab, hidden))
    return min(vocab, math.ceil(cols / COLUMN_ALIGNMENT) * COLUMN_ALIGNMENT)


def _vocabulary_chunk(h: torch.Tensor, weight: torch.Tensor, shifted: torch.Tensor):
    """Every token's logsumexp over one chunk of the vocabulary, and its target's logit where the target
    lies in the chunk (0 elsewhere); `shifted`: the targets less the chunk's first entry."""
    z = nn.functional.linear(h, weight).float()
    inside = (shifted >= 0) & (shifted < weight.shape[0])
    picked = z.gather(1, shifted.clamp(0, weight.shape[0] - 1).unsqueeze(1)).squeeze(1)
    return torch.logsumexp(z, dim=-1), torch.where(inside, picked, 0.0)


def _chunk_loss_and_grad(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                         with_grad: bool = True):
    """One chunk's summed loss, and d(summed loss)/d(logits) in fp32 (None unless `with_grad`)."""
    z = nn.functional.linear(h, weight).float()  # the loss in fp32 whatever the compute dtype
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    if not with_grad:
        return loss, None
    grad = z.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
    grad.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -valid.unsqueeze(1))
    return loss, grad.mul_(valid.unsqueeze(1))


def _forward_chunks(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, rows: int,
                    keep: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss summed over every chunk, and each chunk's logit gradient if `keep`."""
    loss, kept = torch.zeros((), dtype=torch.float32, device=h.device), []
    for s in range(0, h.shape[0], rows):
        part, grad = _chunk_loss_and_grad(h[s:s + rows], weight, targets[s:s + rows], valid[s:s + rows], keep)
        loss = loss + part
        if keep:
            kept.append(grad)
    return loss, kept


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, valid, count, rows, recompute):
        loss, ctx.kept = _forward_chunks(h, weight, targets, valid, rows, keep=not recompute)
        ctx.rows = rows
        ctx.save_for_backward(h, weight, targets, valid, count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, targets, valid, count = ctx.saved_tensors
        scale = grad_out / count
        grad_h = h.new_empty(h.shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        for i, s in enumerate(range(0, h.shape[0], ctx.rows)):
            e = s + ctx.rows
            if ctx.kept:
                grad, ctx.kept[i] = ctx.kept[i], None  # each kept chunk is freed once used
            else:
                grad = _chunk_loss_and_grad(h[s:e], weight, targets[s:e], valid[s:e])[1]
            d = grad.mul_(scale).to(weight.dtype)
            del grad
            if grad_h is not None:
                torch.mm(d, weight, out=grad_h[s:e])
            if ctx.needs_input_grad[1]:
                grad_w = d.t() @ h[s:e] if grad_w is None else grad_w.addmm_(d.t(), h[s:e])
        return grad_h, grad_w, None, None, None, None, None


_linear_cross_entropy = overridable(_LinearCrossEntropy.apply)  # seen by zerofunc.tape


class LinearCrossEntropy(nn.Module):
    """`F.cross_entropy(F.linear(hidden, weight).float(), targets)` (mean over counted tokens),
    computed chunk by chunk; with `recompute` on, backward recomputes the logits instead of
    keeping the gradient. It has no parameters: the weight is passed in, so a head tied to the
    embedding stays tied.

    `num_items_in_batch` (Hugging Face's convention, a number or a scalar tensor) divides the
    summed loss in place of this call's own count of targets: with the global batch's count
    (zerofunc/step.py), every micro-batch's tokens weigh the same, however many each counts."""

    def __init__(self):
        super().__init__()
        self.recompute = False

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        h, t = hidden.flatten(0, -2), targets.flatten()
        valid = (t != IGNORE_INDEX).float()
        count = valid.sum() if num_items_in_batch is None else torch.as_tensor(
            num_items_in_batch, dtype=torch.float32, device=h.device)
        if torch.compiler.is_compiling():  # a traced step: plain ops, the compiler deriving their backward (it
            # cannot trace the Function's kept list), in as many chunks as eager's but cut along the vocabulary:
            # each chunk's weight gradient is then its own rows of the weight's, written once. Cut along the
            # tokens, the weight's gradient is a sum of one vocabulary-wide product per chunk, which the compiled
            # backward cannot accumulate in place: two of them alive at once (gpt2-small: 74 MiB more in bf16,
            # docs/BENCHMARKS.md). Under `recompute` each chunk's logits are computed again in backward, else
            # the partitioner keeps what each chunk's backward needs
            cols = chunk_columns(weight.shape[0], weight.shape[1])
            lses, picked = [], torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
            for first, w in zip(range(0, weight.shape[0], cols), weight.split(cols)):
                lse, target = (checkpoint(_vocabulary_chunk, h, w, t - first, use_reentrant=False,
                                          preserve_rng_state=False) if self.recompute
                               else _vocabulary_chunk(h, w, t - first))
                lses.append(lse)
                picked = picked + target
            return ((torch.logsumexp(torch.stack(lses, dim=1), dim=1) - picked) * valid).sum() / count
        rows = chunk_rows(h.shape[0], weight.shape[0], weight.shape[1])
        if not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
            with torch.no_grad():  # evaluation: the loss alone
                return _forward_chunks(h, weight, t, valid, rows, keep=False)[0] / count
        return _linear_cross_entropy(h, weight, t, valid, count, rows, self.recompute)

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}"


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx)
        ctx.weight_shape = weight.shape
        return nn.functional.embedding(idx, weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_embedded, grad_weight):
        (idx,) = ctx.saved_tensors
        if grad_weight is None:  # the head was not used
            grad_weight = grad_embedded.new_zeros(ctx.weight_shape)
        if grad_embedded is None:
            return None, grad_weight
        # In place: the head's gradient is a fresh product (a matmul's, or autograd's sum of several)
        # that nothing else holds. accumulate=True is deterministic on CUDA too (sorted), unlike index_add_.
        return None, grad_weight.index_put_((idx.flatten(),), grad_embedded.flatten(0, -2), accumulate=True)


@overridable  # seen by zerofunc.tape, which cuts the forward where blocks start
def tied_embedding(idx: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(F.embedding(idx, weight), weight)`, where the head must use the returned weight: its
    gradient then takes the embedding's rows in place. Traced by torch.compile, a plain lookup whose
    backward the compiler adds to the head's (dynamo refuses a Function that returns a view of its input
    when that input is itself made by a Function, as stage 2's whole weights are); its gradient is ATen's
    kernel's, in the weight's dtype (zerofunc/decompositions.py)."""
    if torch.compiler.is_compiling():
        return nn.functional.embedding(idx, weight), weight
    return _TiedEmbedding.apply(idx, weight)
