"""Hugging Face config.json <-> zerofunc model configs, with no network and no weights.

`read_hf_config(path)` builds the config of the matching zerofunc model for a
config.json whose `model_type` is llama, mistral, qwen2 or gpt2; anything it cannot
build faithfully (another architecture, an activation other than SiLU, a RoPE type
other than the default and Llama 3.1's) is a `ValueError` that names it.

What the builder reads, per model type: the shapes (layers, heads, key/value heads, widths,
vocabulary, context), the activation, RoPE's theta and scaling, RMSNorm's epsilon, a tied
head; Llama's attention_bias and mlp_bias (Mistral's and Qwen2's models have no such
switch: Hugging Face ignores them, and so does this), Mistral's sliding_window. Each is
type-checked: a boolean must be JSON true or false ("false" is not false), a number a
number. Fields the model would compute with but the builder does not read (`_FIXED`) are
accepted only at Hugging Face's default value; anything else is refused in one line.
Everything else a config.json holds (token ids, dtype, initializer_range, use_cache, ...)
does not change what the weights compute; dropout is the trainer's --dropout, not the file's.

`hf_config_dict(cfg)` goes the other way, so a test can build Hugging Face's model
from exactly the shapes a preset names.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from zerofunc.models.gpt2 import GPTConfig
from zerofunc.models.llama import LlamaConfig, RopeScaling

SUPPORTED = ("llama", "mistral", "qwen2", "gpt2")
# Fields Hugging Face's model computes with and the builder does not read, at their defaults,
# where the function the weights compute is the one zerofunc builds
_FIXED = {
    "gpt2": {"layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "reorder_and_upcast_attn": False, "add_cross_attention": False},
    "llama": {}, "mistral": {},
    "qwen2": {"use_sliding_window": False},  # its window applies to some layers only (max_window_layers)
}
# Hugging Face's defaults for the fields a config.json may leave out
_CONTEXT = {"llama": 2048, "mistral": 32768, "qwen2": 32768}
_EPS = 1e-6


def read_hf_config(path: str | Path) -> LlamaConfig | GPTConfig:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} holds a JSON {type(doc).__name__}, not a config object")
    try:
        return from_hf_dict(doc)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def from_hf_dict(doc: dict) -> LlamaConfig | GPTConfig:
    kind = doc.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type {kind!r} is not supported; zerofunc builds {', '.join(SUPPORTED)}")

    def need(key: str):
        if doc.get(key) is None:
            raise ValueError(f"missing field {key!r}, needed for model_type {kind}")
        return doc[key]

    def positive_int(key: str, value=None):
        value = need(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"field {key!r} must be a positive integer, got {value!r}")
        return value

    def positive_float(key: str, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def boolean(key: str, default: bool) -> bool:
        value = doc.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"field {key!r} must be true or false, got {value!r}")
        return value

    for key, default in _FIXED[kind].items():
        value = boolean(key, default) if isinstance(default, bool) else positive_float(key, doc.get(key, default))
        if value != default:
            raise ValueError(f"{key} {json.dumps(value)} is not supported (zerofunc builds {kind} with "
                             f"Hugging Face's default, {json.dumps(default)})")

    if kind == "gpt2":
        n_embd = positive_int("n_embd")
        if doc.get("n_inner") not in (None, 4 * n_embd):
            raise ValueError(f"n_inner {doc['n_inner']!r} is not supported (zerofunc's GPT-2 MLP is 4 x n_embd)")
        if doc.get("activation_function", "gelu_new") != "gelu_new":
            raise ValueError(f"activation_function {doc['activation_function']!r} is not supported (gelu_new)")
        if not boolean("tie_word_embeddings", True):
            raise ValueError("an untied GPT-2 head is not supported")
        return GPTConfig(n_layer=positive_int("n_layer"), n_head=positive_int("n_head"),
                         n_embd=n_embd, vocab_size=positive_int("vocab_size"),
                         block_size=positive_int("n_positions", doc.get("n_positions", 1024)))

    if doc.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {doc['hidden_act']!r} is not supported (silu)")
    # RoPE settings: transformers 4 writes rope_theta and rope_scaling, 5 writes rope_parameters
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"field 'rope_scaling' must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = positive_float("rope_theta", rope.get("rope_theta", doc.get("rope_theta", 10000.0)))
    scaling = None
    if rope_type == "llama3":
        try:
            scaling = RopeScaling(positive_float("factor", rope["factor"]),
                                  positive_float("low_freq_factor", rope["low_freq_factor"]),
                                  positive_float("high_freq_factor", rope["high_freq_factor"]),
                                  positive_int("original_max_position_embeddings", rope["original_max_position_embeddings"]))
        except KeyError as e:
            raise ValueError(f"rope scaling of type llama3 is missing {e.args[0]!r}") from None
    elif rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")
    window = None
    if kind == "mistral":
        window = doc.get("sliding_window", 4096)  # null: none (Mistral v0.2 on)
        window = None if window is None else positive_int("sliding_window", window)
    heads = positive_int("num_attention_heads")
    # Llama's switches: biases on q, k, v and o, and on the MLP; Qwen2 has q/k/v biases always
    bias = kind == "llama" and boolean("attention_bias", False)
    mlp_bias = kind == "llama" and boolean("mlp_bias", False)
    return LlamaConfig(
        n_layer=positive_int("num_hidden_layers"), n_head=heads, n_embd=positive_int("hidden_size"),
        intermediate_size=positive_int("intermediate_size"), vocab_size=positive_int("vocab_size"),
        n_kv_head=positive_int("num_key_value_heads", doc.get("num_key_value_heads", heads)),
        head_dim=None if doc.get("head_dim") is None else positive_int("head_dim"),
        block_size=positive_int("max_position_embeddings", doc.get("max_position_embeddings", _CONTEXT[kind])),
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=positive_float("rms_norm_eps", doc.get("rms_norm_eps", _EPS)),
        tie_word_embeddings=boolean("tie_word_embeddings", False),
        qkv_bias=kind == "qwen2" or bias, o_bias=bias, mlp_bias=mlp_bias,
        sliding_window=window, model_type=kind)


def hf_config_dict(cfg: LlamaConfig | GPTConfig) -> dict:
    """The config.json Hugging Face would build this model from (weights aside)."""
    if isinstance(cfg, GPTConfig):
        return {"model_type": "gpt2", "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "tie_word_embeddings": True,
                "bos_token_id": min(50256, cfg.vocab_size - 1), "eos_token_id": min(50256, cfg.vocab_size - 1)}
    doc = {"model_type": cfg.model_type, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
           "num_key_value_heads": cfg.kv_heads, "hidden_size": cfg.n_embd, "head_dim": cfg.head_size,
           "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
           "max_position_embeddings": cfg.block_size, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
           "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        doc["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_context}
    if cfg.model_type == "llama":
        doc |= {"attention_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias}
    if cfg.model_type == "mistral":
        doc["sliding_window"] = cfg.sliding_window
    return doc
