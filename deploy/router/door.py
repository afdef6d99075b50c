"""What the router lets in: a submission's prompt and sampling parameters, checked
against the model (context, vocabulary), the pools that registered and the sampling
ranges, before anything is routed. Text requests are encoded on a thread, never in the
router's loop (``deploy.router.text_encoder``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

from common.config import ServeConfig
from common.control import Submit, unpack_ids
from common.model import Tokenizer
from common.request import BadRequest, SamplingParams, validate
from deploy.router.placement import WorkerInfo, max_tokens
from deploy.router.text_route import TextRoute, encode_prompt


class Door:
    """The router's checks at the door. Token ids are checked in the loop (``admit``); a
    text request is encoded on a thread (``text_job``, ``deploy.router.text_encoder``) and its
    ids checked once back in the loop (``check``). The tokenizer is built by the first
    text request's thread."""

    def __init__(self, config: ServeConfig) -> None:
        self.config, self.mcfg = config, config.model_config()
        self._tokenizer: Tokenizer | None = None
        self._tok_lock = threading.Lock()

    @staticmethod
    def is_text(msg: Submit) -> bool:
        return bool(msg.text or msg.messages)

    def admit(self, msg: Submit, workers: Iterable[WorkerInfo]
              ) -> tuple[list[int], SamplingParams, TextRoute | None]:
        """(prompt ids, sampling parameters as served, None) of a token-ids request.

        Raises:
            BadRequest: what to change.
        """
        assert not self.is_text(msg)
        params = SamplingParams.from_dict(msg.params)
        if msg.stop:
            raise BadRequest("stop strings need a text request (text or messages)")
        limit = self.mcfg.max_position
        if len(msg.prompt) // 4 > limit:   # from the byte count: a huge prompt costs nothing
            raise BadRequest(f"prompt of {len(msg.prompt) // 4} tokens exceeds the "
                             f"model's context of {limit} positions")
        try:
            prompt = unpack_ids(msg.prompt, "prompt").tolist()
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return self.check(prompt, params, None, workers)

    def check(self, prompt: list[int], params: SamplingParams, text: TextRoute | None,
              workers: Iterable[WorkerInfo]
              ) -> tuple[list[int], SamplingParams, TextRoute | None]:
        """Check ids and parameters against the model and the pools that registered now.

        Raises:
            BadRequest: what to change.
        """
        params = validate(prompt, params, vocab_size=self.mcfg.vocab_size,
                          max_tokens=max_tokens(workers),
                          max_new_tokens_limit=self.config.max_new_tokens_limit,
                          max_position=self.mcfg.max_position)
        return list(prompt), params, text

    def text_job(self, msg: Submit) -> Callable[[], tuple[list[int], SamplingParams,
                                                          TextRoute]]:
        """What a thread runs to encode a text request: the prompt ids, the parameters
        with the model's eos ids added as stop ids, and its ``TextRoute``
        (docs/models.md). What is cheap is checked here at once, in the loop.

        Raises:
            BadRequest: what to change.
        """
        params = SamplingParams.from_dict(msg.params)
        if msg.prompt:
            raise BadRequest("send exactly one of prompt token ids, text or messages")
        if self._tokenizer is not None:    # else the thread checks, once it is built
            self._check_text_size(msg, self._tokenizer)

        def run() -> tuple[list[int], SamplingParams, TextRoute]:
            tok = self._tokenizer_now()
            self._check_text_size(msg, tok)
            prompt = encode_prompt(tok, msg.text, msg.messages)
            stops = tuple(dict.fromkeys((*params.stop_token_ids, *tok.eos_token_ids)))
            return prompt, dataclasses.replace(params, stop_token_ids=stops), TextRoute(
                tok, prompt, msg.stop)
        return run

    def _tokenizer_now(self) -> Tokenizer:
        """The model's tokenizer, built by the first thread that asks (the others wait)."""
        with self._tok_lock:
            if self._tokenizer is None:
                tok = Tokenizer.for_model(self.mcfg)
                tok.max_token_chars  # noqa: B018  (reads the vocabulary once, here)
                self._tokenizer = tok
            return self._tokenizer

    def _check_text_size(self, msg: Submit, tok: Tokenizer) -> None:
        """Refuse a text that cannot fit the context before encoding it (8 MB of text once
        took 30 s to encode)."""
        chars = len(msg.text) + sum(len(str(m.get("content", ""))) for m in msg.messages)
        limit = self.mcfg.max_position
        if chars > limit * tok.max_token_chars:
            raise BadRequest(f"text of {chars} characters exceeds the model's context of "
                             f"{limit} positions (one token covers at most "
                             f"{tok.max_token_chars} characters)")
