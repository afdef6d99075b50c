"""OpenAI request bodies -> what pdkv serves: a prompt of token ids and sampling params.

``plan_completion`` and ``plan_chat`` check every field against the deployment's limits
(``Limits``, from the router's config) and raise ``ApiError`` naming the field: 400 for
a bad or unsupported value, 413 for a prompt longer than any pool row or the model's
context, 404 for a model that is not served.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ServeConfig
from deploy.http.errors import ApiError
from deploy.http.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from deploy.http.text import TextModel, no_text_reason


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the deployment."""

    model: str
    vocab_size: int
    max_row: int
    """Prompt + generated tokens: the smaller of a decode row and the model's context."""
    max_prompt: int
    """Longest prompt a prefill row (or a colocated row) holds."""
    max_new_tokens: int

    @classmethod
    def from_config(cls, config: dict, model: str, colocated: bool) -> Limits:
        cfg = ServeConfig.from_dict(config)
        mcfg = cfg.model_config()
        max_row = min(cfg.pool_tokens("decode"), mcfg.max_position)
        max_prompt = max_row - 1 if colocated else min(max_row - 1, cfg.pool_tokens("prefill"))
        return cls(model, mcfg.vocab_size, max_row, max_prompt, cfg.max_new_tokens_limit)


@dataclass(frozen=True)
class Plan:
    """One request as the front door serves it."""

    prompt: list[int]
    params: dict
    """Sampling parameters for the router (``common.request.SamplingParams`` fields)."""
    stop_ids: frozenset[int]
    """Token ids that end the output (``stop_token_ids`` and, for a model with a tokenizer
    unless ``ignore_eos``, its end-of-sequence ids); one of them travels to the decode,
    which then stops by itself, the front door applies the others."""
    stop_strs: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool


def text_chars(body: CompletionRequest | ChatCompletionRequest) -> int:
    """Characters of text a request asks the front door to encode (0 for token ids)."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text()) for m in body.messages)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(map(len, prompt))
    return len(prompt) if isinstance(prompt, str) else 0


def _check_text_size(chars: int, lim: Limits, text: TextModel, param: str) -> None:
    """Refuse a text that cannot fit a row before paying for its encoding (megabytes of
    text take seconds to encode)."""
    if chars > lim.max_row * text.max_token_chars:
        raise ApiError(413, f"{param} of {chars} characters cannot fit this model's "
                            f"maximum context of {lim.max_row} tokens (one token covers at "
                            f"most {text.max_token_chars} characters)", param=param,
                       code="context_length_exceeded")


def plan_completion(req: CompletionRequest, lim: Limits, text: TextModel | None) -> Plan:
    prompt = _prompt_ids(req.prompt, lim, text)
    _refuse_unsupported(req, {"echo": (req.echo, False), "logprobs": (req.logprobs, None, 0),
                              "best_of": (req.best_of, None, 1), "suffix": (req.suffix, None)})
    return _plan(req, prompt, req.max_tokens if req.max_tokens is not None else 16, lim, text)


def plan_chat(req: ChatCompletionRequest, lim: Limits, text: TextModel | None) -> Plan:
    if text is None:
        raise ApiError(400, "chat completions need a chat template: " + no_text_reason(
            lim.model), param="messages")
    _refuse_unsupported(req, {"logprobs": (req.logprobs, None, False),
                              "top_logprobs": (req.top_logprobs, None, 0),
                              "tools": (req.tools, None, []), "tool_choice": (req.tool_choice,
                                                                              None, "none"),
                              "response_format": (req.response_format, None,
                                                  {"type": "text"})})
    _check_text_size(text_chars(req), lim, text, "messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids = text.chat_prompt(messages)
    except ValueError as exc:  # no template, or the template refused the messages
        raise ApiError(400, str(exc), param="messages") from None
    prompt = _check_prompt(ids, lim, "messages")
    n = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if n is None:
        n = min(lim.max_new_tokens, lim.max_row - len(prompt))
    return _plan(req, prompt, n, lim, text)


def _plan(req: _Sampling, prompt: list[int], max_tokens: int, lim: Limits,
          text: TextModel | None) -> Plan:
    _check_model(req.model, lim)
    _check_sampling(req)
    # no getattr with a default: on a pydantic model a missing attribute costs a raise
    param = "max_completion_tokens" if isinstance(req, ChatCompletionRequest) and \
        req.max_completion_tokens else \
        "max_tokens"
    if not 1 <= max_tokens <= lim.max_new_tokens:
        raise ApiError(400, f"{param}={max_tokens}; allowed: 1 to {lim.max_new_tokens}",
                       param=param)
    if len(prompt) + max_tokens > lim.max_row:
        raise ApiError(400, f"this model's maximum context length is {lim.max_row} tokens; "
                            f"the prompt has {len(prompt)} and {param}={max_tokens} asks for "
                            f"{len(prompt) + max_tokens}: lower {param}", param=param)
    stop_ids = _stop_ids(req.stop_token_ids, lim)
    if text is not None and not req.ignore_eos:
        stop_ids |= frozenset(t for t in text.eos_token_ids if 0 <= t < lim.vocab_size)
    stop_strs = _stop_strs(req.stop, lim, text)
    temperature = 1.0 if req.temperature is None else req.temperature
    params = {"max_new_tokens": max_tokens, "temperature": temperature,
              "stop_token": req.stop_token_ids[0] if req.stop_token_ids else min(
                  stop_ids, default=-1),
              "top_k": req.top_k if req.top_k is not None else -1,
              "top_p": req.top_p if req.top_p is not None else 1.0}
    if req.seed is not None:
        params["seed"] = req.seed
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")
    return Plan(prompt, params, stop_ids, stop_strs, req.stream,
                bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats),
                req.return_token_ids)


def _prompt_ids(prompt, lim: Limits, text: TextModel | None) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt holds {len(prompt)} prompts; pdkv serves one prompt "
                                "per request (send several requests)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if text is None:
            raise ApiError(400, no_text_reason(lim.model), param="prompt")
        _check_text_size(len(prompt), lim, text, "prompt")
        prompt = text.encode(prompt)
    if prompt and (min(prompt) < 0 or max(prompt) >= lim.vocab_size):  # C loops: the
        bad = next(t for t in prompt if not 0 <= t < lim.vocab_size)  # hot path's check
        raise ApiError(400, f"prompt token id {bad} out of range; allowed: 0 to "
                            f"{lim.vocab_size - 1}", param="prompt")
    return _check_prompt(list(prompt), lim, "prompt")


def _check_prompt(prompt: list[int], lim: Limits, param: str) -> list[int]:
    if not prompt:
        raise ApiError(400, "the prompt is empty: send at least one token", param=param)
    if len(prompt) > lim.max_prompt:
        raise ApiError(413, f"prompt of {len(prompt)} tokens is longer than any pool row or "
                            f"the model's context allows ({lim.max_prompt} tokens, one more "
                            "for the first output token)", param=param,
                       code="context_length_exceeded")
    return prompt


def _check_model(model: str | None, lim: Limits) -> None:
    if model is not None and model != lim.model:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{lim.model!r} (GET /v1/models)", param="model",
                       code="model_not_found")


def _check_sampling(req: _Sampling) -> None:
    if req.n != 1:
        raise ApiError(400, f"n={req.n}; pdkv returns one choice per request (n=1)",
                       param="n")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise ApiError(400, f"temperature={req.temperature}; allowed: 0 (greedy) to 2",
                       param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise ApiError(400, f"top_p={req.top_p}; allowed: (0, 1] (1 = all tokens)",
                       param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(400, f"top_k={req.top_k}; allowed: -1 or 0 (all tokens) or >= 1",
                       param="top_k")
    _refuse_unsupported(req, {"presence_penalty": (req.presence_penalty, None, 0.0),
                              "frequency_penalty": (req.frequency_penalty, None, 0.0),
                              "logit_bias": (req.logit_bias, None, {})})


def _refuse_unsupported(req, fields: dict[str, tuple]) -> None:
    """Each field's value must be one of the neutral values listed after it."""
    for name, (value, *neutral) in fields.items():
        if value not in neutral:
            raise ApiError(400, f"{name}={value!r} is not supported by pdkv; allowed: "
                                f"{' or '.join(repr(v) for v in neutral)}", param=name)


def _stop_ids(ids: list[int] | None, lim: Limits) -> frozenset[int]:
    for t in ids or []:
        if not 0 <= t < lim.vocab_size:
            raise ApiError(400, f"stop_token_ids holds {t}; allowed: 0 to "
                                f"{lim.vocab_size - 1}", param="stop_token_ids")
    return frozenset(ids or [])


def _stop_strs(stop, lim: Limits, text: TextModel | None) -> tuple[str, ...]:
    strs = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(strs) > 4:
        raise ApiError(400, f"stop holds {len(strs)} strings; at most 4", param="stop")
    if any(not s for s in strs):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    if strs and text is None:
        raise ApiError(400, "stop strings need a tokenizer: " + no_text_reason(lim.model)
                       + "; use stop_token_ids", param="stop")
    return strs
