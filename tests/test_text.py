"""The text path: pdkv's tokenizer, chat template and streaming detokenizer against
transformers' tokenizer on the same directory; stop strings."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from common.model import StopStrings, Tokenizer, write_builtin_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world", " leading space", "café Größe 日本語 🙂🚀", "", "a\nb\n\n  c",
         "<|im_start|>user inline special", "numbers 0123456789 and code: def f(x): ..."]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Größe? 🙂"},
            {"role": "assistant", "content": "Groß."},
            {"role": "user", "content": "And the cache?"}]

# A sentencepiece-style template (Llama 2 like): bos in the template, eos after answers.
LLAMA2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + "
    "' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}")


@cache
def tokenizer_dir(kind: str, root: str) -> Path:
    d = Path(root) / kind
    if kind == "bytelevel":
        write_builtin_tokenizer(d, 384)
        return d
    tok = HfTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([t for t in TEXTS if t] * 3 + ["the cache pages travel"], trainer)
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "chat_template": LLAMA2_TEMPLATE}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return d


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def pair(request, tmp_path_factory) -> tuple[Tokenizer, object]:
    d = tokenizer_dir(request.param, str(tmp_path_factory.getbasetemp()))
    return Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)


def test_encode_and_decode_equal_transformers(pair) -> None:
    ours, theirs = pair
    for text in TEXTS:
        for special in (True, False):
            want = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == want, (text, special)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_chat_template_equals_transformers(pair) -> None:
    ours, theirs = pair
    msgs = MESSAGES if "im_start" in (ours.chat_template or "") else MESSAGES[1:]
    for gen in (True, False):
        text = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == text
        want = theirs.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen,
                                          return_dict=False)
        assert ours.encode_chat(msgs, add_generation_prompt=gen) == list(want)


def test_template_errors_and_missing_templates_are_clear(pair, tmp_path) -> None:
    ours, _ = pair
    if "raise_exception" in (ours.chat_template or ""):
        with pytest.raises(ValueError, match="chat template: Conversation roles must alternate"):
            ours.apply_chat_template([{"role": "assistant", "content": "x"}])
    bare = Tokenizer.from_dir(tokenizer_dir("bytelevel", str(tmp_path)))
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        bare.encode_chat(MESSAGES)
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_eos_ids_come_from_generation_config(pair) -> None:
    ours, _ = pair
    if ours.token_to_id("<|im_end|>") is not None:
        assert ours.eos_token_ids == (2, 4)  # a list in generation_config.json
    else:
        assert ours.eos_token_ids == (2,)
    assert ours.bos_token_id == 1


def test_streaming_never_breaks_characters_and_joins_to_the_full_text(pair) -> None:
    ours, theirs = pair
    prompt = ours.encode("Say:")
    for text in TEXTS[:3] + ["🙂🙂 日本語のキャッシュ café"]:
        out = ours.encode(text, add_special_tokens=False)
        detok = ours.detokenizer(prompt_ids=prompt)
        pieces = [detok.add([t]) for t in out] + [detok.finish()]
        assert all("\ufffd" not in p for p in pieces), pieces
        full = theirs.decode(prompt + out, skip_special_tokens=True)
        assert "".join(pieces) == detok.text == full[len(theirs.decode(
            prompt, skip_special_tokens=True)):]
        several = ours.detokenizer(prompt_ids=prompt)
        chunks = [several.add(out[i:i + 3]) for i in range(0, len(out), 3)]
        assert "".join(chunks) + several.finish() == detok.text


def test_builtin_tokenizer_in_memory_equals_written(tmp_path) -> None:
    write_builtin_tokenizer(tmp_path, 512)
    a, b = Tokenizer.builtin(512), Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
    assert a.eos_token_ids == b.eos_token_ids
    assert a.apply_chat_template(MESSAGES) == b.apply_chat_template(MESSAGES)
    assert a.vocab_size <= 512


def test_stop_strings_hold_back_partial_matches() -> None:
    s = StopStrings(["\nUser:", "END"])
    assert s.feed("Hello") == "Hello"
    assert s.feed(" wor") == " wor"
    assert s.feed("ld\nUs") == "ld"  # "\nUs" could start "\nUser:"
    assert s.feed("ually") == "\nUsually"  # it did not
    assert s.feed(" E") == " "
    assert s.feed("NDING") == ""  # "END" found: everything before it went out already
    assert s.stopped and s.matched == "END"
    assert s.feed("more") == "" and s.finish() == ""
    t = StopStrings(["stop"], include=True)
    assert t.feed("a st") == "a " and t.feed("op b") == "stop" and t.stopped
    u = StopStrings(["xyz"])
    assert u.feed("abcx") == "abc" and u.finish() == "x" and not u.stopped
    assert StopStrings([]).feed("anything") == "anything"
