"""Text for the front door: prompt encoding, chat templates, streamed detokenizing.

The tokenizer lives with the model (``common.model.Tokenizer``, with its incremental
``Detokenizer`` and ``StopStrings``); this module is the front door's one adapter to it.
Where the model package offers no tokenizer, the deployment serves token ids only:
prompts must be token-id lists, outputs carry ``token_ids`` and an empty ``text``, and
text-only features (string prompts, chat messages, stop strings) are refused with a 400
that says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from common.config import ServeConfig

logger = logging.getLogger(__name__)


class TextStream:
    """One output's text: ids in, text pieces out, cut before the first stop string."""

    def __init__(self, detok, stops) -> None:
        self._detok, self._stops = detok, stops

    def feed(self, ids: Sequence[int]) -> tuple[int, str, bool]:
        """(ids taken, text to show, a stop string matched). Ids are taken one by one up to
        the one that completed a stop string."""
        text = ""
        for n, t in enumerate(ids, 1):
            text += self._stops.feed(self._detok.add([t]))
            if self._stops.stopped:
                return n, text, True
        return len(ids), text, False

    def finish(self) -> tuple[str, bool]:
        """(the text held back at the end, a stop string matched in it)."""
        text = self._stops.feed(self._detok.finish())
        return (text, True) if self._stops.stopped else (text + self._stops.finish(), False)


class TextModel:
    """The served model's tokenizer, as the front door uses it."""

    def __init__(self, tokenizer, stop_strings_cls) -> None:
        self._tok, self._stop_strings = tokenizer, stop_strings_cls
        self.eos_token_ids: tuple[int, ...] = tuple(tokenizer.eos_token_ids)

    @property
    def max_token_chars(self) -> int:
        """Most characters one token stands for: a longer text than ``n`` times this cannot
        fit ``n`` tokens."""
        return self._tok.max_token_chars

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Raises ``ValueError`` naming the problem (no template, a refused message)."""
        return self._tok.encode_chat(messages)

    def stream(self, prompt: list[int], stops: Sequence[str]) -> TextStream:
        return TextStream(self._tok.detokenizer(prompt_ids=prompt), self._stop_strings(stops))


def load_text_model(config: dict) -> TextModel | None:
    """The served model's tokenizer, or None when the model package has none."""
    try:
        from common.model import StopStrings, Tokenizer
    except ImportError:
        return None
    mcfg = ServeConfig.from_dict(config).model_config()
    try:
        return TextModel(Tokenizer.for_model(mcfg), StopStrings)
    except (OSError, ValueError) as exc:
        logger.warning("http: model %s: no tokenizer (%s); serving token ids only",
                       mcfg.name, exc)
        return None


def no_text_reason(model: str) -> str:
    return (f"model {model!r} has no tokenizer and serves token ids only: send the prompt "
            "as a list of token ids to /v1/completions")
