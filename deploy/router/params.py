"""A submission's parameters by name: the one vocabulary every client of the router speaks.

``Submit.params`` holds them; the HTTP edge forwards the OpenAI API's fields under these
same names (``max_tokens`` becomes ``max_new_tokens``, the rest keep theirs), so a
request gets the same treatment and the same refusal whichever way it came.

- sampling: every ``SamplingParams`` field (``max_new_tokens``, ``temperature``,
  ``top_p``, ``top_k``, ``min_p``, ``seed``, ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``, ``stop_token_ids``, ``stop_token``...),
  served as ``SamplingParams`` (the workers' device sampler applies each) and checked by
  ``common.request.validate``;
- output: ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output`` and
  ``return_token_ids`` (booleans), the stop policy and the text route (``Options``);
- ``model`` (a string), checked against the served model;
- neutral only: ``n``, ``best_of``, ``echo``, ``logprobs``, ``top_logprobs``,
  ``suffix``, ``min_tokens``, ``logit_bias``, ``tools``, ``tool_choice``,
  ``response_format``, ``parallel_tool_calls``, ``add_special_tokens``,
  ``spaces_between_special_tokens``: accepted at the value that changes nothing, refused
  (``Unsupported``) at any other.

Any other name is refused, so no client believes a parameter took effect when it did not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.request import BadRequest, SamplingParams
from deploy.router.errors import Unsupported

SAMPLING = frozenset(f.name for f in dataclasses.fields(SamplingParams))
NEUTRAL: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (0, False),
    "top_logprobs": (0,), "suffix": ("",), "min_tokens": (0,), "logit_bias": (),
    "tools": (), "tool_choice": ("none", "auto"), "response_format": ("text",),
    "parallel_tool_calls": (True, False), "add_special_tokens": (True,),
    "spaces_between_special_tokens": (True,)}
"""Parameters pdkv serves at these values only (an empty tuple: at none; absent is fine)."""


@dataclass(frozen=True)
class Options:
    """What a request asks of its output besides sampling."""

    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence ids (they are not stop ids)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or a stop id's text) at the end of the output text."""
    return_token_ids: bool = False
    """Return the prompt's token ids with the result (``Done.prompt_ids``)."""
    model: str = ""
    """The model the client asks for ('' any: the served one)."""


_OPTIONS = {f.name: f.type for f in dataclasses.fields(Options)}
KNOWN = SAMPLING | set(NEUTRAL) | set(_OPTIONS)


def read(params: dict) -> tuple[dict, Options]:
    """(the ``SamplingParams`` fields, the output options) of ``params``.

    Raises:
        BadRequest: an unknown name, or an option of the wrong type.
        Unsupported: a neutral-only parameter at another value.
    """
    sampling, options = {}, {}
    for name, value in params.items():
        if name in SAMPLING:
            sampling[name] = value
        elif name in _OPTIONS:
            options[name] = _option(name, value)
        elif name in NEUTRAL:
            _neutral(name, value, NEUTRAL[name])
        else:
            raise BadRequest(f"unrecognized request argument: {name} (pdkv takes: "
                             f"{', '.join(sorted(KNOWN))})", param=name)
    return sampling, Options(**options)


def _option(name: str, value):
    kind = bool if _OPTIONS[name] in (bool, "bool") else str
    if type(value) is not kind:
        raise BadRequest(f"{name}={value!r}; allowed: "
                         f"{'true or false' if kind is bool else 'a string'}", param=name)
    return value


def _neutral(name: str, value, allowed: tuple) -> None:
    if not any(_same(value, v) for v in allowed):
        shown = " or ".join(repr(v) for v in allowed) or "none (leave it out)"
        raise Unsupported(f"{name}={value!r} is not supported by pdkv; allowed: {shown}",
                          param=name)


def _same(value, neutral) -> bool:
    """Equal and of the same kind: ``True`` is not ``1``, ``1.0`` is ``1``."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral
