"""OpenAI request bodies -> the router's ``Submit``: a translation, not a validation.

The router's door (``deploy.router.door``) checks every parameter, once, for every
client; this module only moves the OpenAI API's fields to where the router's messages
carry them:

- ``prompt`` (a string, token ids, or a list holding one of them): ``Submit.text`` or
  ``Submit.prompt``;
- ``messages`` (content as a string or text parts): ``Submit.messages``;
- ``stop`` (a string or a list): ``Submit.stop``;
- ``max_tokens``, ``max_completion_tokens`` (chat: it wins): ``max_new_tokens``;
- ``response_format`` ``{"type": T}``: ``response_format`` = T;
- ``model``: itself (``--served-model-name`` becomes the router's name);
- ``stream``, ``stream_options``, ``user``: the HTTP response only (``user`` ignored);
- every other field: ``Submit.params`` under its own name.

JSON ``null``, ``{}`` and ``[]`` mean "not given" and are left out. A value the router's
messages cannot carry (an object, a list of anything but token ids) travels as its JSON
text, so that the door still names the field in its refusal. The only refusals here are
bodies that do not translate: not a JSON object, a prompt or stop of no OpenAI shape,
several prompts at once, ``stream_options`` without ``stream``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common.control import Submit, pack_ids
from deploy.http.errors import ApiError

NOT_JSON = "the body must be a JSON object (Content-Type: application/json)"
_INT64 = (-(1 << 63), 1 << 64)
"""msgpack's integers; a larger JSON number travels as text."""
_INT32 = (-(1 << 31), 1 << 31)


@dataclass(frozen=True)
class Plan:
    """One request as the front door sends it and answers it."""

    prompt: bytes = b""
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    """The router's parameters by name (``deploy.router.params``)."""
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens_field: str = "max_tokens"
    """The field the client capped its output with (a refusal naming
    ``max_new_tokens`` names this one)."""
    chat: bool = False

    @property
    def return_token_ids(self) -> bool:
        return self.params.get("return_token_ids") is True

    def submit(self, rid: str) -> Submit:
        return Submit(rid, self.prompt, self.params, text=self.text,
                      messages=self.messages, stop=self.stop)

    def field_of(self, param: str) -> str:
        """The client's field for a parameter the router names."""
        if param == "max_new_tokens":
            return self.max_tokens_field
        return "messages" if self.chat and param == "prompt" else param


def plan(body: object, chat: bool, served_name: str, router_model: str) -> Plan:
    """The ``Plan`` of an OpenAI body; ``served_name`` (``--served-model-name``) is what
    clients call ``router_model``.

    Raises:
        ApiError: 400, the body does not translate (see the module doc).
    """
    if not isinstance(body, dict):
        raise ApiError(400, NOT_JSON, param="body")
    body = {k: v for k, v in body.items()   # null, {} and [] are "not given"
            if v is not None and v != {} and v != []}
    stream, include_usage, continuous = _stream(body)
    body.pop("user", None)
    prompt, text, messages = _prompt(body, chat)
    stop = _stop(body.pop("stop", None))
    max_field = "max_completion_tokens" if chat and "max_completion_tokens" in body else \
        "max_tokens"
    if max_field in body:
        body["max_new_tokens"] = body.pop(max_field)
    body.pop("max_tokens", None)   # chat: max_completion_tokens won
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("type"), str) and len(fmt) == 1:
        body["response_format"] = fmt["type"]
    if body.get("model") == served_name:
        body["model"] = router_model
    params = {name: _wire(value) for name, value in body.items()}
    return Plan(prompt, text, messages, stop, params, stream, include_usage, continuous,
                max_field, chat)


def _stream(body: dict) -> tuple[bool, bool, bool]:
    stream = body.pop("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream={stream!r}; allowed: true or false", param="stream")
    opts = body.pop("stream_options", None)
    if opts is None:
        return stream, False, False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")
    known = {"include_usage", "continuous_usage_stats"}
    if not isinstance(opts, dict) or set(opts) - known or not all(
            isinstance(v, bool) for v in opts.values()):
        raise ApiError(400, "stream_options takes include_usage and continuous_usage_stats "
                            "(true or false)", param="stream_options")
    return stream, opts.get("include_usage", False), opts.get("continuous_usage_stats", False)


def _prompt(body: dict, chat: bool) -> tuple[bytes, str, list[dict[str, str]]]:
    """(ids, text, messages): one of them set (or none: the door says what is missing)."""
    if chat:
        return b"", "", _messages(body.pop("messages", []))
    prompt = body.pop("prompt", [])
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt holds {len(prompt)} prompts; pdkv serves one prompt "
                                "per request (send several requests)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return b"", prompt, []
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        try:
            return pack_ids(prompt), "", []
        except ValueError:   # an id past int32 travels as -1: the door refuses it as
            return pack_ids([t if _INT32[0] <= t < _INT32[1] else -1   # outside the
                             for t in prompt]), "", []                  # vocabulary
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list holding "
                        "one of them", param="prompt")


def _messages(messages) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be a list of messages", param="messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m) -> dict[str, str]:
    """One chat message with its content as one text (OpenAI's text parts joined)."""
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
            content if content is not None else "", str):
        raise ApiError(400, f"messages[{i}] must be an object with a string role and a "
                            "content of text (a string or text parts)", param="messages")
    out = {"role": m["role"], "content": content or ""}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    return stops


def _wire(value):
    """``value`` as ``Submit.params`` carries it: a scalar, token ids, or its JSON text."""
    if type(value) in (bool, float, str):
        return value
    if type(value) is int and _INT64[0] <= value < _INT64[1]:
        return value
    if isinstance(value, list) and all(type(t) is int and _INT64[0] <= t < _INT64[1]
                                       for t in value):
        return value
    return json.dumps(value, separators=(",", ":"))
