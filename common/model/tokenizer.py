"""Text <-> token ids for a checkpoint directory: ``tokenizer.json`` through the
``tokenizers`` library, the chat template rendered with ``jinja2`` the way transformers
renders it, bos/eos as the tokenizer config says, stop ids from the generation config.

The face (used by the OpenAI front door and the request path)::

    tok = Tokenizer.from_dir("/models/llama-3.2-1b")
    ids = tok.encode("Hello")                      # bos added if the checkpoint says so
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])   # template, then encode
    text = tok.decode(ids)                         # special tokens skipped
    tok.eos_token_ids                              # every id that ends generation
    detok = tok.detokenizer()                      # streaming: see common.model.text
    piece = detok.add([id1, id2]); rest = detok.finish()

Nothing is downloaded; a directory without ``tokenizer.json`` raises ``FileNotFoundError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HfTokenizer

from common.model.builtin_text import CHAT_TEMPLATE, SPECIAL_TOKENS, builtin_tokenizer_json
from common.model.chat_template import render_chat_template
from common.model.config import ModelConfig
from common.model.text import Detokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                  "cls_token", "mask_token")


class Tokenizer:
    """A checkpoint's tokenizer; build with ``from_dir``. Thread-safe for reading."""

    def __init__(self, tokenizer: _HfTokenizer, config: dict, eos_token_ids: Sequence[int],
                 chat_template: str | None, path: str = "") -> None:
        self._tok, self.config, self.path = tokenizer, config, path
        self.special_tokens = {name: _content(config.get(name)) for name in _SPECIAL_NAMES
                               if _content(config.get(name))}
        """Special token strings by name (``bos_token``, ``eos_token``...), as the chat
        template sees them."""
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        """Every token id that ends generation (generation_config.json's eos_token_id,
        an int or a list; else config.json's; else the tokenizer's eos_token)."""
        self.chat_template = chat_template
        self._max_chars: int | None = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer of a checkpoint directory (``tokenizer.json`` required)."""
        d = Path(path)
        file = d / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{d} has no tokenizer.json (pdkv reads fast tokenizers "
                                    "only; a sentencepiece tokenizer.model must be converted)")
        tok = _HfTokenizer.from_file(str(file))
        config = _read_json(d / "tokenizer_config.json")
        template = _chat_template(d, config)
        eos = _eos_ids(d, tok, config)
        return cls(tok, config, eos, template, str(d))

    @classmethod
    def builtin(cls, vocab_size: int) -> Tokenizer:
        """The built-in models' tokenizer (``common.model.builtin_text``), built in memory."""
        tok = _HfTokenizer.from_str(builtin_tokenizer_json(vocab_size))
        pad, bos, eos, _, im_end = SPECIAL_TOKENS
        config = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "add_bos_token": True}
        return cls(tok, config, [tok.token_to_id(eos), tok.token_to_id(im_end)], CHAT_TEMPLATE)

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> Tokenizer:
        """The tokenizer of ``cfg``'s checkpoint directory, or the built-in one."""
        return cls.from_dir(cfg.path) if cfg.path else cls.builtin(cfg.vocab_size)

    # -- text -> ids ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """Most characters one token stands for (the longest vocabulary entry): a text
        longer than ``n * max_token_chars`` cannot encode to ``n`` tokens or fewer, which
        a front door checks before paying for the encoding."""
        if self._max_chars is None:
            self._max_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)))
        return self._max_chars

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor of
        ``tokenizer.json`` adds bos (and eos) as it is written to, as transformers >= 5
        does (it ignores ``add_bos_token`` in tokenizer_config.json once tokenizer.json
        exists).

        Releases the GIL while it encodes (``encode_batch`` does, ``encode`` does not:
        1.2 MB of text held it 2.4 s), so a long text encoded on a thread leaves the
        process's other threads running."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: object) -> str:
        """The chat rendered as text (special tokens included), as transformers renders it.

        Raises:
            ValueError: the checkpoint has no chat template, or the template refused the
                messages (its own ``raise_exception`` text is in the message).
        """
        if not self.chat_template:
            raise ValueError(f"{self.path or 'this tokenizer'} has no chat template "
                             "(tokenizer_config.json chat_template or chat_template.jinja); "
                             "send a plain prompt instead")
        return render_chat_template(self.chat_template, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens, **kwargs})

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **kwargs: object) -> list[int]:
        """``apply_chat_template`` then encode without adding special tokens (the
        template writes its own bos), as transformers' ``tokenize=True`` does."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # -- ids -> text ----------------------------------------------------------------------
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids the tokenizer does not know decode to nothing."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] = ()) -> Detokenizer:
        """An incremental decoder for one streamed output (``prompt_ids`` give context, so
        a leading space of the first output token is kept as in the full text)."""
        return Detokenizer(self.decode, skip_special_tokens=skip_special_tokens,
                           context=list(prompt_ids)[-4:])

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


def _content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    return data


def _chat_template(d: Path, config: dict) -> str | None:
    """``chat_template.jinja`` (transformers >= 4.43 writes it), else the config's own,
    which may be a list of named templates (the one named ``default`` is used)."""
    file = d / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(d: Path, tok: _HfTokenizer, config: dict) -> list[int]:
    for file in ("generation_config.json", "config.json"):
        eos = _read_json(d / file).get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list) and eos and all(isinstance(e, int) for e in eos):
            return list(eos)
    token = _content(config.get("eos_token"))
    eos_id = tok.token_to_id(token) if token else None
    return [] if eos_id is None else [eos_id]
