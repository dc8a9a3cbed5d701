"""How a model's parameters are named and laid out in a Hugging Face checkpoint, both ways.

Loading (zerofunc/pretrained.py) and exporting (zerofunc/hf_export.py) use the same map, so
what one writes the other reads. Three differences exist between a model's own parameters
and the tensors of its Hugging Face files:

- **Prefix.** Our GPT-2 names its parameters `wte.weight`, `h.0.attn.c_attn.weight`; Hugging
  Face's `GPT2LMHeadModel` saves `transformer.wte.weight`, and the original OpenAI-converted
  files have no prefix at all. Both are read; `transformer.` is written.
- **Transposed weights.** GPT-2's four `Conv1D` weights are stored (in, out); ours are
  `nn.Linear`, (out, in).
- **Tensors to skip.** A tied model's files carry the embedding only; if a file carries the
  head anyway it is the same tensor, and is skipped. Old GPT-2 files carry the causal mask
  buffers (`attn.bias`, `attn.masked_bias`); any model's buffers are not weights.

Our Llama family already uses `LlamaForCausalLM`'s names, and a Hugging Face model passed to
`zerofunc.initialize` has its own, so for them the map is the identity.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch.nn as nn

GPT2_PREFIX = "transformer."
_CONV1D = re.compile(r"(^|\.)(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_GPT2_MASKS = re.compile(r"(^|\.)attn\.(bias|masked_bias)$")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class HFNames:
    """The map for one model: `key(name)` is the file's tensor of parameter `name`, stored
    transposed when `transposed(name)`; `skipped(key)` says a file tensor is no parameter's."""

    prefix: str = ""
    conv1d: bool = False             # GPT-2's Conv1D weights are stored (in, out)
    tied: bool = False               # the head is the embedding: a file's lm_head.weight is skipped
    buffers: frozenset = field(default_factory=frozenset)  # the model's buffer names, as keys

    def key(self, name: str) -> str:
        return self.prefix + name

    def transposed(self, name: str) -> bool:
        return self.conv1d and _CONV1D.search(name) is not None

    def skipped(self, key: str) -> bool:
        if self.tied and key in ("lm_head.weight", self.prefix + "lm_head.weight"):
            return True
        if self.conv1d and _GPT2_MASKS.search(key):
            return True
        return key in self.buffers or key.removeprefix(self.prefix) in self.buffers


def is_tied(model: nn.Module) -> bool:
    """Whether the model's output head is its token embedding (our configs' or Hugging Face's flag)."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    if cfg is None:
        return False
    return bool(getattr(cfg, "tie_word_embeddings", False)) or _is_our_gpt2(model)


def _is_our_gpt2(model: nn.Module) -> bool:
    from zerofunc.models.gpt2 import GPT  # our GPT-2 is always tied, and unprefixed

    return isinstance(model, GPT)


def hf_names(model: nn.Module, file_keys: Optional[Iterable[str]] = None) -> HFNames:
    """The map for `model`. Given the file's tensor names, our GPT-2 reads them with or without the
    `transformer.` prefix, whichever the file uses; without them (writing) it uses the prefix."""
    buffers = frozenset(name for name, _ in model.named_buffers())
    if not _is_our_gpt2(model):
        return HFNames(tied=is_tied(model), buffers=buffers)
    keys = None if file_keys is None else list(file_keys)
    prefixed = keys is None or any(k.startswith(GPT2_PREFIX) for k in keys)
    return HFNames(prefix=GPT2_PREFIX if prefixed else "", conv1d=True, tied=True, buffers=buffers)


def architecture(model: nn.Module) -> Optional[str]:
    """The Hugging Face class that loads our model's export (None for a model that is not ours)."""
    cfg = getattr(model, "cfg", None)
    if _is_our_gpt2(model):
        return ARCHITECTURES["gpt2"]
    return ARCHITECTURES.get(getattr(cfg, "model_type", None)) if cfg is not None else None
