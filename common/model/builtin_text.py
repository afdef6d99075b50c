"""The tokenizer of the built-in models: a byte-level BPE trained with ``tokenizers`` on a
small embedded text, with a ChatML chat template, written in the Hugging Face layout.

Byte-level (as Llama 3 and Qwen2 are), so every string round-trips, multi-byte
characters span several tokens (what streaming must handle), and training is
deterministic: every process that builds it for the same vocabulary gets the same file.
Model ids past the tokenizer's vocabulary decode to nothing.
"""

from __future__ import annotations

import itertools
import json
import os
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>",
                  "<|im_end|>")
"""Ids 0-4: pad, bos, eos and the ChatML turn markers."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_CORPUS = """\
Prefill computes the key and value cache of a prompt; decode extends it one token at a
time. A page holds sixteen slots, and a row maps positions to slots. The router sends each
request to a prefill worker and a decode worker; the pages travel between them and come
back to the pool when the request is done. Speculative decoding proposes a few tokens and
verifies them in one pass. The quick brown fox jumps over the lazy dog, then naps.
Les caches de clés et de valeurs sont transférés entre les nœuds. Größe, Straße, café.
キャッシュを転送します。缓存页面。Кэш страниц. 🙂 🚀 ✓ — “quotes” and 'apostrophes'.
def free_kv_row(kv, ranges): return [(0, 16), (16, 32)]  # numbers 0123456789
"""


@lru_cache(maxsize=8)
def builtin_tokenizer_json(vocab_size: int) -> str:
    """``tokenizer.json`` text of the built-in tokenizer with exactly ``vocab_size`` ids.

    The embedded text trains about 600 tokens; a larger vocabulary (``small``'s 4096) is
    filled with word pieces that no merge produces, so that encoding is what training
    made and every id a model samples still decodes to visible text (an id past the
    tokenizer would decode to nothing: a random model's output would be mostly empty)."""
    return _pad_vocab(_trained_json(vocab_size), vocab_size)


def _trained_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    bos = SPECIAL_TOKENS[1]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()


_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_NUCLEI = ("a", "e", "i", "o", "u")


def _pad_vocab(text: str, vocab_size: int) -> str:
    """``text``'s tokenizer with its BPE vocabulary filled up to ``vocab_size`` ids by
    made-up words (a space, then consonant-vowel syllables: " bako", " melu"): pieces
    without merges, so they decode but never come out of encoding."""
    data = json.loads(text)
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    next_id = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    syllables = [o + n for o in _ONSETS for n in _NUCLEI]
    words = ("\u0120" + "".join(w) for n in (1, 2, 3)  # \u0120: the byte-level space
             for w in itertools.product(syllables, repeat=n))
    for word in words:
        if next_id >= vocab_size:
            break
        if word not in taken:
            vocab[word] = next_id
            next_id += 1
    return json.dumps(data, ensure_ascii=False)


def write_builtin_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size}: a byte-level tokenizer needs at least "
                         f"{256 + len(SPECIAL_TOKENS)} ids")
    (d / "tokenizer.json").write_text(builtin_tokenizer_json(vocab_size))
    pad, bos, eos, _, im_end = SPECIAL_TOKENS
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "pad_token": pad, "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20}, indent=2) + "\n")
    (d / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, SPECIAL_TOKENS.index(im_end)],
        "pad_token_id": 0}, indent=2) + "\n")
