"""The text side of one request at the router: prompt text in, streamed text out.

The router is the only place that turns text into ids and ids back into text. A request
may carry a plain prompt (``text``) or chat ``messages`` instead of token ids; the router
encodes it with the model's tokenizer (the chat template for messages) and forwards
token ids to the workers as for any request. Whatever the prompt, when the model has a
tokenizer the output is detokenized incrementally (``common.model.Detokenizer``, never
splitting a character) and cut at the first stop string (``StopStrings``).

Stop policy (one for every request): every stop token id (the request's, and the model's
eos ids unless ``ignore_eos``) travels to the workers, so the decode ends there by itself
(``finished``); such an id is passed on but its text is not shown (unless
``include_stop_str_in_output``). A stop string ends the output here, before it (or after
it with ``include_stop_str_in_output``); the router then tells the decode to finish
(``Stop``), which frees its row as ``finished`` too.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.model import StopStrings, Tokenizer
from common.request import BadRequest


class TextRoute:
    """Detokenizer, stop ids and stop strings of one request's output.

    Args:
        tokenizer: the model's tokenizer.
        prompt: the prompt's token ids (context for the first output token).
        stop: stop strings (the output text ends at the first one).
        stop_ids: every id that ends the output (the decode stops on them too).
        skip_special_tokens: leave special tokens out of the text.
        include_stop: show the stop string, or a stop id's text, at the end.
    """

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], stop: Iterable[str],
                 stop_ids: Iterable[int], *, skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        self.detok = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens,
                                           prompt_ids=prompt)
        self.stops = StopStrings(list(stop), include=include_stop)
        self.stop_ids = frozenset(stop_ids)
        self.include_stop = include_stop
        self.hit_stop_id = False
        """A stop id passed: the decode ends the request by itself."""
        self.num_ids = 0
        """Output ids passed on to the client."""
        self.text = ""
        """Output text passed on to the client."""

    @property
    def stopped(self) -> bool:
        """A stop string ended the output (the router must tell the decode)."""
        return self.stops.stopped

    def feed(self, ids: list[int]) -> tuple[list[int], str]:
        """New output ids -> (ids, text) to pass on; nothing once the output ended.

        Ids are passed on up to the stop id, or the one that completed a stop string."""
        out_ids, out_text = [], ""
        for t in ids:
            if self.stopped or self.hit_stop_id:
                break
            out_ids.append(t)
            if t in self.stop_ids:
                self.hit_stop_id = True
                if not self.include_stop:
                    break
            out_text += self.stops.feed(self.detok.add([t]))
        self.num_ids += len(out_ids)
        self.text += out_text
        return out_ids, out_text

    def finish(self) -> str:
        """Text still held back at the end of the output (after ``feed``)."""
        rest = "" if self.stopped else self.stops.feed(self.detok.finish())
        rest += self.stops.finish()
        self.text += rest
        return rest


def encode_prompt(tokenizer: Tokenizer, text: str, messages: list[dict]) -> list[int]:
    """Token ids of a text request: ``messages`` through the chat template, else ``text``.

    Raises:
        BadRequest: the chat template refused the messages.
    """
    try:
        return tokenizer.encode_chat(messages) if messages else tokenizer.encode(text)
    except ValueError as exc:
        raise BadRequest(str(exc), param="messages" if messages else "prompt") from None
