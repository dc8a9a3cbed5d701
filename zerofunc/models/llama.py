"""The Llama family (Llama 2 and 3, Mistral, Qwen2), written out in one file.

One decoder covers them all: RMSNorm before attention and MLP, rotary position
embeddings, grouped-query attention (n_kv_head key/value heads shared by groups of
query heads), a SwiGLU MLP, and an output head that is tied to the embedding or not.
Qwen2 adds biases to q/k/v; Mistral v0.1 limits attention to a sliding window.

Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`), so a
consolidated checkpoint loads into `LlamaForCausalLM` as it is, and the math follows
theirs op for op (RMSNorm in fp32, rotate-half RoPE), so the logits agree too.

As with GPT-2, the model is built on the meta device and `init_param` draws each
parameter from (seed, name) alone, whatever the world size.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerofunc.lm_head import LinearCrossEntropy, tied_embedding


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent stretch of RoPE to a longer context (rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_embd: int
    intermediate_size: int
    vocab_size: int
    n_kv_head: Optional[int] = None      # default: n_head (no grouping); filled in on construction
    head_dim: Optional[int] = None       # default: n_embd // n_head; filled in on construction
    block_size: int = 4096               # the context (max_position_embeddings)
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False               # Qwen2
    o_bias: bool = False                 # Llama's attention_bias puts a bias on o_proj too
    mlp_bias: bool = False
    sliding_window: Optional[int] = None  # Mistral v0.1: each token attends to the last this many
    model_type: str = "llama"            # Hugging Face's name for the architecture: llama, mistral or qwen2

    def __post_init__(self) -> None:
        # the defaults made explicit, so two configs of one model compare equal however they were written
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.head_dim is None and self.n_embd % self.n_head == 0:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        for field in ("n_layer", "n_head", "n_embd", "intermediate_size", "vocab_size", "block_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}; give head_dim")
        if self.head_size % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {self.head_size}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, n_kv_head=8)
# The published shapes (the config.json of each model on the Hugging Face hub), plus a tiny one
# for tests and CPU runs: byte vocabulary, 6 query heads sharing 2 key/value heads, an odd MLP width.
MODELS = {
    "llama-tiny": LlamaConfig(n_layer=2, n_head=6, n_kv_head=2, n_embd=132, intermediate_size=347, vocab_size=256,
                              block_size=256),
    "llama2-7b": LlamaConfig(n_layer=32, n_head=32, n_embd=4096, intermediate_size=11008, vocab_size=32000),
    "llama3-8b": LlamaConfig(n_layer=32, n_head=32, n_embd=4096, intermediate_size=14336, block_size=8192, **_LLAMA3),
    "llama3-70b": LlamaConfig(n_layer=80, n_head=64, n_embd=8192, intermediate_size=28672, block_size=8192, **_LLAMA3),
    "llama3.1-405b": LlamaConfig(n_layer=126, n_head=128, n_embd=16384, intermediate_size=53248, block_size=131072,
                                 rope_scaling=RopeScaling(), **_LLAMA3),
    "mistral-7b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                              vocab_size=32000, block_size=32768, sliding_window=4096, model_type="mistral"),
    "qwen2.5-7b": LlamaConfig(n_layer=28, n_head=28, n_kv_head=4, n_embd=3584, intermediate_size=18944,
                              vocab_size=152064, block_size=131072, rope_theta=1e6, rms_norm_eps=1e-6, qkv_bias=True,
                              model_type="qwen2"),
    "qwen2.5-72b": LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=29568,
                               vocab_size=152064, block_size=131072, rope_theta=1e6, qkv_bias=True,
                               model_type="qwen2"),
}


def inverse_frequencies(head_size: int, theta: float, scaling: Optional[RopeScaling]) -> list[float]:
    """RoPE's inverse frequencies, computed in fp32 on CPU as Hugging Face computes them.

    A list of floats, not a tensor: the model keeps them as a constant, so no buffer
    needs materializing and no step allocates them anew on the host.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size))
    if scaling is None:
        return inv.tolist()
    # Llama 3.1: long wavelengths stretched by `factor`, short ones kept, the band between interpolated
    low_wavelen = scaling.original_context / scaling.low_freq_factor
    high_wavelen = scaling.original_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    stretched = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, stretched).tolist()


def rotary(inv_freq: list[float], T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, (T, head_size), in the activations' dtype."""
    inv = torch.tensor(inv_freq, dtype=torch.float32, device=device)
    angles = torch.arange(T, device=device).float()[:, None] * inv[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # the mean square in fp32 whatever the compute dtype
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size, self.window = cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.sliding_window
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_size, cfg.n_embd, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        gqa = self.n_kv_head != self.n_head  # the kernel reads each key/value head for its group of queries
        if self.window is not None and T > self.window:
            i = torch.arange(T, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Hugging Face's `LlamaModel`: the embedding, the layers and the final norm (the `model.` of every name)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)


class Llama(nn.Module):
    """A Llama-family causal LM; `LlamaForCausalLM`'s parameters under the same names."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.inv_freq = inverse_frequencies(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
        self.model = Decoder(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.loss = LinearCrossEntropy()  # the head's logits and loss, chunk by chunk

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                sample_ids: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy over the counted targets (not -100) when `targets` is given.

        `num_items_in_batch` (Hugging Face's convention) divides the summed loss instead of this
        batch's own count: zerofunc/step.py passes the global batch's, so ranks train like one device.
        `sample_ids` is accepted for the trainer's common call and unused: the family has no dropout.
        """
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds the context of {self.cfg.block_size}")
        if self.cfg.tie_word_embeddings:  # the head's weight is the embedding's
            x, head = tied_embedding(idx, self.model.embed_tokens.weight)
        else:
            x, head = self.model.embed_tokens(idx), self.lm_head.weight
        cos, sin = rotary(self.inv_freq, T, x.device, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        if targets is None:
            return F.linear(x, head)
        return self.loss(x, head, targets, num_items_in_batch)

    def shard_units(self) -> list[str]:
        """Submodules that stage 3 gathers one at a time: the decoder layers."""
        return [f"model.layers.{i}" for i in range(len(self.model.layers))]

    def init_param(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """Hugging Face's initialization of one parameter, on CPU, from (seed, name) alone.

        Normal(0, 0.02) weights, zero biases, unit RMSNorm gains.
        """
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.normal(0.0, 0.02, size=shape, generator=gen)


def llama_config(name: str, **overrides) -> LlamaConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return replace(MODELS[name], **overrides)
