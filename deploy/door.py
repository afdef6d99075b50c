"""What the router lets in: a submission's prompt and sampling parameters, checked
against the model (context, vocabulary), the pools that registered and the sampling
ranges, before anything is routed. Text requests are encoded here (``TextRoute``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from common.codec import unpack_ids
from common.config import ServeConfig
from common.model import Tokenizer
from common.node import Submit
from common.request import BadRequest, SamplingParams, validate
from deploy.placement import WorkerInfo, max_tokens
from deploy.text_route import TextRoute, encode_prompt


class Door:
    """The router's checks at the door (the tokenizer is built at the first text request)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config, self.mcfg = config, config.model_config()
        self._tokenizer: Tokenizer | None = None

    def admit(self, msg: Submit, workers: Iterable[WorkerInfo]
              ) -> tuple[list[int], SamplingParams, TextRoute | None]:
        """(prompt ids, sampling parameters as served, the text side or None).

        Raises:
            BadRequest: what to change.
        """
        params = SamplingParams.from_dict(msg.params)
        prompt, params, text = self._prompt(msg, params)
        params = validate(prompt, params, vocab_size=self.mcfg.vocab_size,
                          max_tokens=max_tokens(workers),
                          max_new_tokens_limit=self.config.max_new_tokens_limit,
                          max_position=self.mcfg.max_position)
        return list(prompt), params, text

    def _prompt(self, msg: Submit, params: SamplingParams):
        """Token ids of the prompt; a text request is encoded, gets the model's eos ids as
        stop ids and a ``TextRoute`` (docs/models.md). Ids are checked against the
        context from their byte count first, so a huge prompt costs nothing."""
        if not (msg.text or msg.messages):
            if msg.stop:
                raise BadRequest("stop strings need a text request (text or messages)")
            limit = self.mcfg.max_position
            if len(msg.prompt) // 4 > limit:
                raise BadRequest(f"prompt of {len(msg.prompt) // 4} tokens exceeds the "
                                 f"model's context of {limit} positions")
            try:
                return unpack_ids(msg.prompt, "prompt").tolist(), params, None
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        if msg.prompt:
            raise BadRequest("send exactly one of prompt token ids, text or messages")
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.for_model(self.mcfg)
        tok = self._tokenizer
        self._check_text_size(msg, tok)
        prompt = encode_prompt(tok, msg.text, msg.messages)
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *tok.eos_token_ids)))
        params = dataclasses.replace(params, stop_token_ids=stops)
        return prompt, params, TextRoute(tok, prompt, msg.stop)

    def _check_text_size(self, msg: Submit, tok: Tokenizer) -> None:
        """Refuse a text that cannot fit the context before encoding it: encoding runs in
        the router's loop (8 MB of text once took it 30 s, past every worker's lease)."""
        chars = len(msg.text) + sum(len(str(m.get("content", ""))) for m in msg.messages)
        limit = self.mcfg.max_position
        if chars > limit * tok.max_token_chars:
            raise BadRequest(f"text of {chars} characters exceeds the model's context of "
                             f"{limit} positions (one token covers at most "
                             f"{tok.max_token_chars} characters)")
