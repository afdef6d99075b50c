"""A trained model's text handling (SmolLM2-135M-Instruct, tests/real_model.py: ByteLevel BPE,
49,152 tokens, ChatML special tokens, eos from generation_config.json): pdkv's
``Tokenizer`` encodes, decodes and renders chats exactly as transformers' tokenizer of the
same directory, and its streaming detokenizer never emits a broken character."""

from __future__ import annotations

import pytest

from common.model import Tokenizer

TEXTS = [
    "Hello world",
    "Café crème brûlée, naïve façade – déjà vu",
    "日本語のテキストと中文的句子",
    "emoji 🙂🚀 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",  # special tokens inside text
    "  leading spaces and trailing  ",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ça va ? 🙂"}],
]


@pytest.fixture(scope="module")
def both(real_model_dir):
    import transformers

    return Tokenizer.from_dir(real_model_dir), transformers.AutoTokenizer.from_pretrained(
        real_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(both, text) -> None:
    tok, hf = both
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_equals_transformers(both, messages) -> None:
    tok, hf = both
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == text
    assert tok.encode_chat(messages) == hf(text, add_special_tokens=False)["input_ids"]
    assert text.endswith("<|im_start|>assistant\n")


def test_special_tokens_and_eos(both) -> None:
    tok, hf = both
    assert tok.eos_token_ids == (2,) == (hf.convert_tokens_to_ids("<|im_end|>"),)
    assert tok.bos_token_id == 1 and tok.vocab_size == 49152
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.encode("<|im_end|>") == [2]  # an added token is one id, never split


def test_streaming_detokenizer_never_breaks_a_character(both) -> None:
    tok, _ = both
    text = "Bonjour, ça va ? 日本語 🙂🚀 👩‍👩‍👧 fin."
    ids = tok.encode(text)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4  # ids that split characters
    context = tok.encode("Say: ")
    d = tok.detokenizer(prompt_ids=context)
    pieces = [d.add([i]) for i in ids] + [d.finish()]
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) == d.text == tok.decode(ids)
