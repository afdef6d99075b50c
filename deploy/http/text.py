"""Text for the front door: prompt encoding, chat templates, incremental detokenizing.

The model's tokenizer lives with the model (``common.model``); this module is the front
door's one adapter to it. A model without a tokenizer (the built-in seeded models) serves
token ids only: prompts must be token-id lists, outputs carry ``token_ids`` and an empty
``text``, and text-only features (string prompts, chat messages, stop strings) are refused
with a 400 that says so.
"""

from __future__ import annotations

from typing import Protocol


class Detokenizer(Protocol):
    def add(self, ids: list[int]) -> str:
        """Text that the new ids complete (may be empty while a character is partial)."""

    def flush(self) -> str:
        """Whatever text is still held back at the end of the output."""


class TextModel(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def chat_prompt(self, messages: list[dict]) -> list[int]: ...

    def detokenizer(self, prompt: list[int]) -> Detokenizer: ...


def load_text_model(config: dict) -> TextModel | None:
    """The tokenizer of the served model, or None when it has none."""
    return None


def no_text_reason(model: str) -> str:
    return (f"model {model!r} has no tokenizer and serves token ids only: send the prompt "
            "as a list of token ids to /v1/completions")
