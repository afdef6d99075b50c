"""OpenAI response bodies and Server-Sent Events chunks, for completions and chat.

Streaming follows the OpenAI chunk format: one ``data: {json}`` event per delta, chat's
first chunk carries ``{"role": "assistant"}``, the last chunk of the choice carries its
``finish_reason``; with ``stream_options.include_usage`` every chunk has ``"usage": null``
and a final chunk with empty ``choices`` carries the usage; ``data: [DONE]`` ends the
stream. A request that fails mid-stream gets ``data: {"error": {...}}`` and ``[DONE]``.
"""

from __future__ import annotations

import json

from deploy.http.generation import Delta, Generation

DONE = b"data: [DONE]\n\n"
_encode = json.JSONEncoder(separators=(",", ":")).encode
"""One encoder for every chunk (``json.dumps`` with separators builds one per call)."""


def sse(obj: dict) -> bytes:
    return b"data: " + _encode(obj).encode() + b"\n\n"


class Shaper:
    """Builds one endpoint's bodies and chunks for one generation."""

    def __init__(self, gen: Generation, model: str, chat: bool) -> None:
        self.gen, self.model, self.chat = gen, model, chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.gen.rid, "object": obj, "created": self.gen.created,
                "model": self.model}

    # -- whole responses -----------------------------------------------------------------
    def body(self, text: str) -> dict:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": self.gen.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.gen.plan.return_token_ids:
            choice["token_ids"] = list(self.gen.ids)
        out = {**self._head(self.object), "choices": [choice], "usage": self.gen.usage()}
        if self.gen.plan.return_token_ids:
            out["prompt_token_ids"] = self.gen.prompt_ids
        return out

    # -- streams -------------------------------------------------------------------------
    def first_chunk(self) -> bytes | None:
        """Chat opens with the assistant's role; completions have nothing to say yet."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None, [])

    def chunk(self, delta: Delta) -> bytes:
        body = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        return self._chunk(body, delta.finish_reason, delta.ids)

    def _chunk(self, delta_body: dict, finish: str | None, ids: list[int]) -> bytes:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta_body
        else:
            choice["text"] = delta_body.get("content", "")
        if self.gen.plan.return_token_ids:
            choice["token_ids"] = ids
        out = {**self._head(self.chunk_object), "choices": [choice]}
        plan = self.gen.plan
        if plan.continuous_usage:
            out["usage"] = self.gen.usage()
        elif plan.include_usage:
            out["usage"] = None
        return sse(out)

    def usage_chunk(self) -> bytes:
        return sse({**self._head(self.chunk_object), "choices": [],
                    "usage": self.gen.usage()})
