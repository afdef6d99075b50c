"""The text side of one request at the router: prompt text in, streamed text out.

A request may carry a plain prompt (``text``) or chat ``messages`` instead of token ids;
the router encodes it with the model's tokenizer (the chat template for messages), adds
the checkpoint's eos ids to the request's stop ids, and forwards token ids to the
workers as for any request. Tokens coming back are detokenized incrementally
(``common.model.Detokenizer``) and cut at the first stop string (``StopStrings``); when a
stop string ends the output, the router aborts the request on its workers (their rows are
freed with reason ``aborted``) and reports ``stop`` to the client.
"""

from __future__ import annotations

from common.model import StopStrings, Tokenizer
from common.request import BadRequest


class TextRoute:
    """Detokenizer and stop strings of one request.

    Args:
        tokenizer: the model's tokenizer.
        prompt: the prompt's token ids (context for the first output token).
        stop: stop strings (the output ends before the first one, which is not shown).
    """

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], stop: list[str]) -> None:
        self.detok = tokenizer.detokenizer(prompt_ids=prompt)
        self.stops = StopStrings(stop)
        self.num_ids = 0
        """Output ids passed on to the client."""
        self.text = ""
        """Output text passed on to the client."""

    @property
    def stopped(self) -> bool:
        """A stop string ended the output."""
        return self.stops.stopped

    def feed(self, ids: list[int]) -> tuple[list[int], str]:
        """New output ids -> (ids, text) to pass on; nothing once a stop string matched.

        Ids are passed on up to the one that completed the stop string."""
        out_ids, out_text = [], ""
        for t in ids:
            if self.stops.stopped:
                break
            out_ids.append(t)
            out_text += self.stops.feed(self.detok.add([t]))
        self.num_ids += len(out_ids)
        self.text += out_text
        return out_ids, out_text

    def finish(self) -> str:
        """Text still held back at the end of the output (after ``feed``)."""
        rest = "" if self.stops.stopped else self.stops.feed(self.detok.finish())
        rest += self.stops.finish()
        self.text += rest
        return rest


def encode_prompt(tokenizer: Tokenizer, text: str, messages: list[dict]) -> list[int]:
    """Token ids of a text request: ``messages`` through the chat template, else ``text``.

    Raises:
        BadRequest: both or neither given, or the chat template refused the messages.
    """
    if bool(text) == bool(messages):
        raise BadRequest("send exactly one of prompt token ids, text or messages")
    try:
        return tokenizer.encode_chat(messages) if messages else tokenizer.encode(text)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
