"""Small random Hugging Face causal LMs of many families, built from a config (nothing downloaded): two
layers, width 32, a vocabulary of 53 with id 0 special, no dropout, each family's own default attention
(BLOOM's, eager, is the only one it has). GPT-2's and Llama's builders are tests/test_hf.py's `hf_model`.

OTHER_FAMILIES are the ones whose blocks or glue differ from GPT-2's and Llama's, each in a way of its
own: ALiBi and a norm on the embeddings (BLOOM), attention and MLP side by side on one norm (Falcon), a
parallel residual and a partial rotary (GPT-NeoX), learned positions at an offset and a tied head (OPT),
norms after each sublayer, soft-capped logits and scaled embeddings (Gemma 2), a mixture of experts
routed per token (Mixtral), norms on the queries and keys (Qwen3). LLAMA_LIKE are built as Llama is,
with a difference or two (biases, a sliding window, a fused projection). tests/test_hf.py trains
OTHER_FAMILIES like one device; benchmarks/hf_families.py runs them all eager and compiled whole."""
from __future__ import annotations

from typing import Callable

import torch.nn as nn


def _family(model: str, config: str, **shape) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers
        return getattr(transformers, model)(getattr(transformers, config)(
            vocab_size=53, bos_token_id=0, eos_token_id=0, pad_token_id=0, **shape))
    return build


_DECODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=40, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)

OTHER_FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "bloom": _family("BloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=32, n_head=4, hidden_dropout=0.0,
                     attention_dropout=0.0),
    "falcon": _family("FalconForCausalLM", "FalconConfig", num_hidden_layers=2, hidden_size=32,
                      num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0),
    "gpt_neox": _family("GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2, hidden_size=32,
                        intermediate_size=40, num_attention_heads=4, max_position_embeddings=32),
    "opt": _family("OPTForCausalLM", "OPTConfig", num_hidden_layers=2, hidden_size=32, ffn_dim=40,
                   num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
                   attention_dropout=0.0),
    "gemma2": _family("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, **_DECODER),
    "mixtral": _family("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                       **_DECODER),
    "qwen3": _family("Qwen3ForCausalLM", "Qwen3Config", head_dim=8, **_DECODER),
}

LLAMA_LIKE: dict[str, Callable[[], nn.Module]] = {
    "qwen2": _family("Qwen2ForCausalLM", "Qwen2Config", **_DECODER),
    "mistral": _family("MistralForCausalLM", "MistralConfig", **_DECODER),
    "gemma": _family("GemmaForCausalLM", "GemmaConfig", head_dim=8, **_DECODER),
    "phi3": _family("Phi3ForCausalLM", "Phi3Config", **_DECODER),
    "olmo": _family("OlmoForCausalLM", "OlmoConfig", **_DECODER),
    "stablelm": _family("StableLmForCausalLM", "StableLmConfig", **_DECODER),
    "gptj": _family("GPTJForCausalLM", "GPTJConfig", n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}

_SEQ2SEQ = dict(d_model=32, encoder_ffn_dim=40, decoder_ffn_dim=40, encoder_attention_heads=4,
                decoder_attention_heads=4,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=0)

_T5GEMMA_STACK = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=20, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, vocab_size=53, attention_dropout=0.0)

# Models of two stacks of blocks, each family's builder and its stacks (encoder's first): T5's relative position bias
# made by each stack's first block and handed on to the others, BART's and Whisper's learned positions (Whisper's
# encoder over log-mel features through two convolutions), T5Gemma's Gemma 2 layers whose loss divides by the
# count it is given, CLIP's text and vision towers
TWO_STACKS: dict[str, tuple[Callable[[], nn.Module], tuple[str, str]]] = {
    "t5": (_family("T5ForConditionalGeneration", "T5Config", num_layers=2, num_decoder_layers=3, d_model=32, d_ff=40,
                   num_heads=4, d_kv=8, dropout_rate=0.0, decoder_start_token_id=0),
           ("encoder.block", "decoder.block")),
    "bart": (_family("BartForConditionalGeneration", "BartConfig", encoder_layers=2, decoder_layers=2,
                     max_position_embeddings=32, forced_eos_token_id=None, **_SEQ2SEQ),
             ("model.encoder.layers", "model.decoder.layers")),
    "whisper": (_family("WhisperForConditionalGeneration", "WhisperConfig", encoder_layers=2, decoder_layers=2,
                        num_mel_bins=8, max_source_positions=16, max_target_positions=16, **_SEQ2SEQ),
                ("model.encoder.layers", "model.decoder.layers")),
    "t5gemma": (_family("T5GemmaForConditionalGeneration", "T5GemmaConfig", encoder=_T5GEMMA_STACK,
                        decoder={**_T5GEMMA_STACK, "num_hidden_layers": 3}, dropout_rate=0.0, attention_dropout=0.0,
                        decoder_start_token_id=0), ("model.encoder.layers", "model.decoder.layers")),
    "clip": (lambda: __import__("transformers").CLIPModel(__import__("transformers").CLIPConfig(
        text_config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=40, num_attention_heads=4,
                         vocab_size=53, max_position_embeddings=16),
        vision_config=dict(num_hidden_layers=3, hidden_size=32, intermediate_size=40, num_attention_heads=4,
                           image_size=16, patch_size=8))),
             ("text_model.encoder.layers", "vision_model.encoder.layers")),
}
