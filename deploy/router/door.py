"""The router's door: the one admission of every request, whichever client sent it.

A submission (``Submit``: token ids, a text or chat messages, stop strings, parameters
by name, ``deploy.router.params``) passes the door in two steps:

1. ``read``, in the loop: what is cheap. Every parameter's name and kind, the model,
   stop strings, the messages' shape, and a text too long for the context before anyone
   pays for encoding it.
2. ``admit``, once the prompt is ids (a text encoded in the loop when short, else on a
   thread of ``deploy.router.text_encoder``): the limits of the model and of the workers
   that registered (the prompt alone, prompt + ``max_new_tokens``), the sampling ranges
   (``common.request.validate``), the stop policy (the request's stop ids and, unless
   ``ignore_eos``, the model's eos ids, all sent to the workers), and the request's
   ``TextRoute`` when the model has a tokenizer.

Every refusal is a ``BadRequest`` whose ``code`` (``deploy.router.errors``) the router
sends back in its ``Error``; only the HTTP edge maps codes to statuses.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from common.config import ServeConfig
from common.control import Submit, unpack_ids
from common.model import Tokenizer
from common.request import BadRequest, SamplingParams, validate
from deploy.router import params as vocabulary
from deploy.router.errors import ContextLengthExceeded, ModelNotFound, Unavailable
from deploy.router.placement import WorkerInfo, capacity
from deploy.router.text_route import TextRoute, encode_prompt

logger = logging.getLogger(__name__)

LOOP_TEXT_CHARS = 4096
"""Texts up to this many characters are encoded in the loop: a few thousand characters
encode in well under a millisecond, less than a thread's hand-off costs; megabytes take
seconds, and go to the encoding threads."""
MAX_STOP_STRINGS = 4
"""As the OpenAI API: each costs a scan of every new piece of text."""
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Ask:
    """A submission as the door read it, before its text is encoded."""

    msg: Submit
    sampling: dict
    """``SamplingParams`` fields as the client sent them."""
    options: vocabulary.Options
    chars: int = 0
    """Characters of text to encode (0: token ids)."""

    @property
    def is_text(self) -> bool:
        return bool(self.msg.text or self.msg.messages)

    @property
    def prompt_param(self) -> str:
        """The parameter a prompt problem names."""
        return "messages" if self.msg.messages else "prompt"


@dataclass(frozen=True)
class Admitted:
    """A request that passed the door, as the workers will serve it."""

    prompt: list[int]
    params: SamplingParams
    text: TextRoute | None
    """Its output text (None: the model has no tokenizer)."""
    options: vocabulary.Options


class Door:
    """The router's checks at the door (see the module doc). The model's tokenizer is
    loaded once, here; without one the deployment serves token ids only."""

    def __init__(self, config: ServeConfig) -> None:
        self.config, self.mcfg = config, config.model_config()
        self.model_name = config.model_name
        """The served model's name (a checkpoint's directory's): what ``model`` may say."""
        self.tokenizer = self._load_tokenizer()
        self.max_text = 0 if self.tokenizer is None else \
            self.mcfg.max_position * self.tokenizer.max_token_chars
        """Characters a text that fits the context has at most."""

    def _load_tokenizer(self) -> Tokenizer | None:
        try:
            return Tokenizer.for_model(self.mcfg)
        except (OSError, ValueError) as exc:
            logger.warning("router: model %s has no tokenizer (%s); serving token ids only",
                           self.mcfg.name, exc)
            return None

    # -- 1. what is cheap, in the loop ------------------------------------------------------
    def read(self, msg: Submit) -> Ask:
        """Raises ``BadRequest`` (or a subclass) naming what to change."""
        sampling, options = vocabulary.read(msg.params)
        if options.model and options.model != self.model_name:
            raise ModelNotFound(f"the model {options.model!r} does not exist; this "
                                f"deployment serves {self.model_name!r}", param="model")
        if msg.messages:
            _check_messages(msg.messages)
        ask = Ask(msg, sampling, options, len(msg.text) + (
            sum(len(m.get("content", "")) for m in msg.messages) if msg.messages else 0))
        self._check_prompt_kind(ask)
        if msg.stop:
            self._check_stop(msg.stop)
        self._check_size(ask)
        return ask

    def _check_prompt_kind(self, ask: Ask) -> None:
        msg = ask.msg
        given = sum(map(bool, (msg.prompt, msg.text, msg.messages)))
        if given != 1:
            raise BadRequest(("empty prompt: send" if not given else "send only") + " one of "
                             "token ids, a text or chat messages", param=ask.prompt_param)
        if ask.is_text and self.tokenizer is None:
            raise BadRequest(self.no_text(), param=ask.prompt_param)

    def no_text(self) -> str:
        return (f"model {self.model_name!r} has no tokenizer and serves token ids "
                "only: send the prompt as a list of token ids")

    def _check_stop(self, stop: list[str]) -> None:
        if len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}",
                             param="stop")
        if any(not isinstance(s, str) or not s for s in stop):
            raise BadRequest("stop strings must be non-empty strings", param="stop")
        if self.tokenizer is None:
            raise BadRequest(f"stop strings need a tokenizer: {self.no_text()}; use "
                             "stop_token_ids", param="stop")

    def _check_size(self, ask: Ask) -> None:
        """A prompt that cannot fit the context is refused before it is unpacked or
        encoded (8 MB of text once took 30 s to encode)."""
        limit, msg = self.mcfg.max_position, ask.msg
        if len(msg.prompt) // 4 > limit:
            raise ContextLengthExceeded(f"prompt of {len(msg.prompt) // 4} tokens exceeds "
                                        f"the model's context of {limit} positions",
                                        param="prompt")
        if ask.chars > self.max_text and self.tokenizer is not None:
            raise ContextLengthExceeded(
                f"text of {ask.chars} characters exceeds the model's context of {limit} "
                f"positions (one token covers at most {self.tokenizer.max_token_chars} "
                "characters)", param=ask.prompt_param)

    # -- the prompt as ids -----------------------------------------------------------------
    def off_loop(self, ask: Ask) -> bool:
        """Its text is long: encode it on a thread, not in the router's loop."""
        return ask.chars > LOOP_TEXT_CHARS

    def encode(self, ask: Ask) -> list[int]:
        """The prompt's token ids (a thread runs this for a long text).

        Raises:
            BadRequest: the ids do not unpack, or the chat template refused the messages.
        """
        if not ask.is_text:
            try:
                return unpack_ids(ask.msg.prompt, "prompt").tolist()
            except ValueError as exc:
                raise BadRequest(str(exc), param="prompt") from None
        return encode_prompt(self.tokenizer, ask.msg.text, ask.msg.messages)

    # -- 2. the limits, with the workers that registered now ---------------------------------
    def admit(self, ask: Ask, prompt: list[int], workers: Iterable[WorkerInfo]) -> Admitted:
        """Raises ``BadRequest`` (or a subclass) naming what to change; a request that is
        bad in itself is told so even while no worker is ready (``Unavailable`` then)."""
        try:
            max_row, max_prompt = self._rows(workers)
        except Unavailable:
            self._params(ask, prompt, self.mcfg.max_position)
            raise
        if len(prompt) > max_prompt:
            raise ContextLengthExceeded(
                f"prompt of {len(prompt)} tokens is longer than any pool row or the model's "
                f"context allows ({max_prompt} tokens, one more for the first output token)",
                param=ask.prompt_param)
        params = self._params(ask, prompt, max_row)
        text = None if self.tokenizer is None else TextRoute(
            self.tokenizer, prompt, ask.msg.stop, params.stop_token_ids,
            skip_special_tokens=ask.options.skip_special_tokens,
            include_stop=ask.options.include_stop_str_in_output)
        return Admitted(prompt, params, text, ask.options)

    def _params(self, ask: Ask, prompt: list[int], max_row: int) -> SamplingParams:
        """The sampling parameters as served: the stop policy applied, every range and
        the row (``max_row``: prompt + output) checked."""
        sampling = ask.sampling
        if ask.msg.messages and "max_new_tokens" not in sampling:
            # a chat answer may run to the end of the row, as far as the limit allows
            sampling = {**sampling, "max_new_tokens": max(1, min(
                self.config.max_new_tokens_limit, max_row - len(prompt)))}
        return validate(prompt, self._stop_policy(sampling, ask.options),
                        vocab_size=self.mcfg.vocab_size, max_tokens=max_row,
                        max_new_tokens_limit=self.config.max_new_tokens_limit,
                        max_position=self.mcfg.max_position)

    def _rows(self, workers: Iterable[WorkerInfo]) -> tuple[int, int]:
        """(longest row: prompt + output, longest prompt) some ready worker holds now.

        Raises:
            Unavailable: no worker is ready to serve (``placement.capacity``)."""
        row, prompt = capacity(workers)
        return min(self.mcfg.max_position, row), min(self.mcfg.max_position - 1, prompt)

    def _stop_policy(self, sampling: dict, options: vocabulary.Options) -> SamplingParams:
        """Every id that ends the output travels to the workers: the request's
        ``stop_token_ids`` (and ``stop_token``), and the model's eos ids unless
        ``ignore_eos``."""
        params = SamplingParams.from_dict(sampling)
        ids, single = list(params.stop_token_ids), params.stop_token
        if type(single) is int and single >= 0:   # else validate names what is wrong
            ids.insert(0, single)
            single = -1
        if not options.ignore_eos and self.tokenizer is not None:
            ids += self.tokenizer.eos_token_ids
        try:
            ids = tuple(dict.fromkeys(ids))
        except TypeError:   # an unhashable item: not an id
            raise BadRequest(f"stop_token_ids must be integers in [0, {self.mcfg.vocab_size})",
                             param="stop_token_ids") from None
        return replace(params, stop_token=single, stop_token_ids=ids)



def _check_messages(messages: list) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
            raise BadRequest(f"messages[{i}] must be an object with a role and a text "
                             "content", param="messages")
        if m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role={m.get('role')!r}; allowed: "
                             f"{', '.join(ROLES)}", param="messages")
