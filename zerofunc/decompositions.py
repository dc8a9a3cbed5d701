"""How the step's compiled graphs are lowered where inductor's defaults would differ from the eager step:
inductor's decomposition table, less what would change a kernel's memory or numerics against eager's."""
from __future__ import annotations

import functools

import torch


@torch.library.custom_op("zerofunc::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                       scale_grad_by_freq: bool) -> torch.Tensor:
    """An embedding's gradient by ATen's kernel, the eager step's, opaque to the compiler (`decompositions`)."""
    return torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


@embedding_backward.register_fake
def _(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty((num_weights, *grad.shape[indices.dim():]))


@functools.cache
def decompositions() -> dict:
    """Inductor's decompositions, but an embedding's gradient is ATen's kernel, the eager step's. Torch's
    decomposition accumulates a 16-bit embedding's rows in a vocabulary-by-width fp32 buffer and rounds it
    (gpt2-small's tied embedding: 147 MiB more than eager at the end of backward; Llama-3-8B's untied one:
    2.1 GB); the kernel writes the gradient in the weight's dtype. Not left out of the table for inductor to
    fall back on: torch 2.11's inductor refuses an implicit fallback for an op its own table decomposes."""
    from torch._inductor.decomposition import select_decomp_table
    aten = torch.ops.aten.embedding_dense_backward
    table = {op: fn for op, fn in select_decomp_table().items() if getattr(op, "overloadpacket", None) is not aten}
    table[aten.default] = embedding_backward
    return table
