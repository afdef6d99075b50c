"""Request bodies of the OpenAI API that pdkv serves, as pydantic models: the OpenAPI
page (``/docs``) only.

No request is validated with these: the fast lane hands the parsed JSON to
``deploy.http.translate``, and the router's door (``deploy.router.door``) checks every
field, refusing an unknown one by name, so a client never believes a parameter took
effect when it did not. Fields of the OpenAI API that pdkv does not implement are served
at their neutral values only (``deploy.router.params``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[int]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """Send a last chunk with ``usage`` and empty ``choices`` before ``[DONE]``."""
    continuous_usage_stats: bool = False
    """vLLM extension: ``usage`` in every chunk."""


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = None
    """Default 1.0, as in the OpenAI API; 0 is greedy."""
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    """vLLM extension (its ``bench serve`` sends 1.0)."""
    min_p: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False
    """pdkv and vLLM extension: ``prompt_token_ids`` and per-choice ``token_ids``."""
    ignore_eos: bool = False
    """vLLM extension: keep generating past the model's end-of-sequence ids."""
    skip_special_tokens: bool = True
    """vLLM extension: leave special tokens out of the text."""
    include_stop_str_in_output: bool = False
    """vLLM extension: keep the stop string (or a stop id's text) in the text."""


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """Newer name of ``max_tokens``; wins when both are given."""
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
