"""The door's vocabulary of refusals: each a ``BadRequest`` with a ``code``.

The router answers a refused submission with ``Error(rid, message, code, param)``; the
code says what kind of refusal it is, and only the HTTP edge turns codes into statuses
(``deploy.http.errors``). Every client (the HTTP front door, ``pdkv run``'s driver, any
``deploy.router.client.Client``) meets the same codes and the same messages.

- ``bad_request`` (400): a bad or unknown parameter, an empty prompt, prompt +
  ``max_new_tokens`` past the context or the longest row;
- ``unsupported`` (400): a known parameter at a value pdkv does not implement;
- ``context_length_exceeded`` (413): the prompt alone (or its text) cannot fit any row
  or the context;
- ``model_not_found`` (404): ``model`` names another model;
- ``overloaded`` (429): ``encode_queue`` texts are being encoded already;
- ``encode_timeout`` (503): a text was not encoded within ``encode_timeout_s``;
- ``unavailable`` (503): no ready worker takes the request now;
- ``encode_failed`` (500): the tokenizer failed (a fault, not the client's).
"""

from __future__ import annotations

from common.request import BadRequest


class Unsupported(BadRequest):
    """A parameter pdkv knows but serves only at its neutral value."""

    code = "unsupported"


class ContextLengthExceeded(BadRequest):
    """The prompt alone cannot fit: longer than any row or the model's context."""

    code = "context_length_exceeded"


class ModelNotFound(BadRequest):
    """The request names a model this deployment does not serve."""

    code = "model_not_found"


class Overloaded(BadRequest):
    """``encode_queue`` texts are queued or being encoded already."""

    code = "overloaded"


class EncodeTimeout(BadRequest):
    """The text was not encoded within ``encode_timeout_s`` of its submission."""

    code = "encode_timeout"


class EncodeFailed(BadRequest):
    """The tokenizer (or the chat template) failed on this text."""

    code = "encode_failed"


class Unavailable(BadRequest):
    """No ready worker can take the request now (none registered, or all paused)."""

    code = "unavailable"
