"""The special ids python -m train.prepare writes around each document: a beginning of text (BOS) before it,
as the tokenizer's post-processor puts one there (--bos), and the end of text (EOS) after it (--eos).

Documents are encoded without special tokens and prepare writes both ends itself, since a
post-processor's own suffix (RoBERTa's `</s>`, say) would be a second end beside the EOS. The BOS is
asked of the post-processor once, by running it: what `tokenizer(text)` in transformers puts first,
Llama 3's `<|begin_of_text|>` or Llama 2's `<s>`, and nothing for GPT-2 or Qwen2, whose
post-processor adds none.
"""
from __future__ import annotations

from typing import Optional

from tokenizers import Tokenizer

from train.data import DataError

# The names end-of-text goes by in the tokenizers people fine-tune (GPT-2/Qwen/Phi, Llama 3, Llama 2/Mistral,
# ChatML, Gemma), in order of preference: Qwen2 has <|endoftext|> and <|im_end|>, and documents end in the first.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>", "<eos>")
# The names beginning-of-text goes by (Llama 3, Llama 2/Mistral, Gemma, GPT-J's fine-tunes), for --bos always
# where the post-processor adds none.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
BOS_MODES = ("auto", "always", "never")
PROBE = "a"  # any text that encodes to at least one token: the post-processor's prefix is what comes before it


def find_eos(tokenizer: Tokenizer, name: Optional[str], path: str) -> int:
    """The id appended after every document: `name` if given, else the first of EOS_NAMES the tokenizer
    has among its added (special) tokens, else in its vocabulary."""
    if name is not None:
        eos = tokenizer.token_to_id(name)
        if eos is None:
            raise DataError(f"--eos {name!r} is not a token of {path}")
        return eos
    found = _named(tokenizer, EOS_NAMES)
    if found is not None:
        return found
    raise DataError(f"tokenizer {path} has none of the end-of-text tokens {' '.join(EOS_NAMES)}: "
                    f"name the token that ends a document with --eos TOKEN")


def find_bos(tokenizer: Tokenizer, mode: str, path: str) -> list[int]:
    """The ids written before every document. auto: what the tokenizer's post-processor puts before a
    sequence (none when it adds none); always: that, or else the first of BOS_NAMES the tokenizer has;
    never: none."""
    if mode not in BOS_MODES:
        raise ValueError(f"--bos must be one of {', '.join(BOS_MODES)}, got {mode!r}")
    if mode == "never":
        return []
    prefix = post_processor_prefix(tokenizer, path)
    if prefix or mode == "auto":
        return prefix
    found = _named(tokenizer, BOS_NAMES)
    if found is not None:
        return [found]
    raise DataError(f"--bos always: tokenizer {path} adds no beginning-of-text token and has none of "
                    f"{' '.join(BOS_NAMES)}; use --bos never or --bos auto")


def post_processor_prefix(tokenizer: Tokenizer, path: str) -> list[int]:
    """The ids the tokenizer's post-processor puts before a single sequence, found by running it (whatever
    its kind: a template, BERT's or RoBERTa's, a sequence of them): the ids before the probe's first token."""
    if tokenizer.post_processor is None or tokenizer.post_processor.num_special_tokens_to_add(False) == 0:
        return []
    bare = tokenizer.encode(PROBE, add_special_tokens=False)
    if not bare.ids:
        raise DataError(f"tokenizer {path} encodes {PROBE!r} to nothing, so whether its post-processor adds a "
                        f"beginning-of-text token cannot be told: name --bos always or --bos never")
    processed = tokenizer.post_process(bare, add_special_tokens=True)
    return processed.ids[:processed.sequence_ids.index(0)]  # sequence_ids: None for what the processor added


def _named(tokenizer: Tokenizer, names: tuple[str, ...]) -> Optional[int]:
    """The id of the first of `names` among the tokenizer's added (special) tokens, else in its vocabulary."""
    added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    found = [added[n] for n in names if n in added] or [i for i in map(tokenizer.token_to_id, names) if i is not None]
    return found[0] if found else None
