"""Tiny Hugging Face model directories, built here with random weights and saved with
`save_pretrained(max_shard_size=...)` in several shards, as a Hub download would look:

- llama: untied head, grouped-query attention (2 key/value heads for 4 query heads);
- qwen2: tied head (its files carry the embedding only), q/k/v biases;
- gpt2: tied head, Conv1D weights stored (in, out), keys prefixed with `transformer.`.

Widths do not divide 2 or 3 ranks' shards evenly, so tensors straddle shard boundaries.
"""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "gpt2")


def hf_model(family: str, vocab: int = 300, context: int = 128):
    """A Hugging Face causal LM of `family` with random weights, in eval mode (no dropout)."""
    import transformers as tf

    if family == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=40, intermediate_size=41, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=context,
                             tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(num_hidden_layers=2, hidden_size=40, intermediate_size=43, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=context,
                             tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_head=3, n_embd=33, vocab_size=vocab, n_positions=context, bos_token_id=0,
                            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(family)
    return model.eval()


def save_hf_dir(family: str, out: Path, seed: int = 0, vocab: int = 300, shard: str = "40KB",
                dtype: torch.dtype = torch.float32) -> Path:
    """Save a tiny `family` model to `out` in several safetensors shards with their index; returns `out`."""
    torch.manual_seed(seed)
    model = hf_model(family, vocab).to(dtype)
    model.save_pretrained(out, max_shard_size=shard)
    return Path(out)
