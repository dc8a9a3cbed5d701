"""The GPT-2 family, written out in one file (after nanoGPT).

Built on the meta device: constructing even gpt2-xl allocates nothing. The engine
then materializes, rank by rank, only the elements each rank owns, with `init_param`,
whose values depend on the parameter's name and the seed but never on the world size.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerofunc.lm_head import LinearCrossEntropy, tied_embedding


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257
    block_size: int = 1024
    dropout: float = 0.0  # off by default; when on, masks are seeded per global sample (sample_dropout)

    def __post_init__(self) -> None:
        for field in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")


# The published GPT-2 shapes (Radford et al. 2019), plus a tiny one for tests and CPU runs.
MODELS = {
    "gpt2-tiny": GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=256, block_size=256),
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}


def model_config(name: str, **overrides) -> GPTConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return replace(MODELS[name], **overrides)


def sample_dropout(x: torch.Tensor, p: float, sample_ids: torch.Tensor | None, site: int,
                   training: bool) -> torch.Tensor:
    """Dropout whose mask for row b depends only on (sample_ids[b], site).

    A global RNG would give a sample a different mask depending on how many ranks
    split the batch; seeding each sample's mask by its global identity keeps N ranks
    equivalent to one device even with dropout on.
    """
    if p == 0 or not training:
        return x
    if sample_ids is None:
        raise ValueError("dropout > 0 needs sample_ids, so that masks do not depend on the rank count")
    if x.device.type == "meta":
        return x / (1 - p)
    keep = torch.stack([
        torch.rand(x.shape[1:], generator=torch.Generator().manual_seed((int(s) * 1_000_003 + site) % 2**63)) >= p
        for s in sample_ids.tolist()])
    return x * keep.to(x.device) / (1 - p)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no dropout on attention weights
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, index: int):
        super().__init__()
        self.dropout, self.site = cfg.dropout, 1 + 2 * index
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        def drop(y: torch.Tensor, k: int) -> torch.Tensor:
            # self.site is read only when dropout is on: no per-block constant, so under
            # --compile every block shares one compiled graph
            if not (self.dropout and self.training):
                return y
            return sample_dropout(y, self.dropout, sample_ids, self.site + k, self.training)

        x = x + drop(self.attn(self.ln_1(x)), 0)
        return x + drop(self.mlp(self.ln_2(x)), 1)


class GPT(nn.Module):
    """GPT-2 with the output head tied to the token embedding, as published."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.loss = LinearCrossEntropy()  # the head's logits and loss, chunk by chunk

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                sample_ids: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy over the counted targets (not -100) when `targets` is given.

        `num_items_in_batch` (Hugging Face's convention) divides the summed loss instead of this
        batch's own count: zerofunc/step.py passes the global batch's, so ranks train like one device.
        `sample_ids` name each row's global sample; dropout (when on) seeds by them.
        """
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds the context of {self.cfg.block_size}")
        x, head = tied_embedding(idx, self.wte.weight)  # the head's weight is the embedding's
        x = x + self.wpe(torch.arange(T, device=idx.device))
        x = sample_dropout(x, self.cfg.dropout, sample_ids, 0, self.training)
        for block in self.h:
            x = block(x, sample_ids)
        x = self.ln_f(x)
        if targets is None:
            return F.linear(x, head)
        return self.loss(x, head, targets, num_items_in_batch)  # in fp32 whatever the compute dtype

    def shard_units(self) -> list[str]:
        """Submodules that stage 3 gathers one at a time: the transformer blocks."""
        return [f"h.{i}" for i in range(len(self.h))]

    def init_param(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """GPT-2's initialization of one parameter, on CPU, from (seed, name) alone.

        Normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layer),
        zero biases, unit LayerNorm gains. Each parameter draws from its own generator,
        so its values do not depend on which other parameters a rank materializes.
        """
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if ".ln_" in name or name.startswith("ln_"):
            return torch.ones(shape)
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.normal(0.0, std, size=shape, generator=gen)
