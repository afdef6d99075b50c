"""Streaming text: incremental detokenisation and stop strings.

``Detokenizer`` turns a growing list of token ids into text pieces without ever emitting
a broken multi-byte character: each step decodes a short window of recent tokens and
emits only what the window adds, holding back text that ends in an incomplete UTF-8
sequence (decoded as U+FFFD) until the next token completes it (the offsets algorithm
vLLM and TGI use). The pieces joined are ``detok.text``.

``StopStrings`` cuts a stream at the first of several stop strings, holding back any tail
that could still become one, so a client never sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental decoder of one output.

    Args:
        decode: ``ids -> text`` (the tokenizer's ``decode``).
        skip_special_tokens: passed to ``decode``.
        context: ids before the output (a few prompt tokens) that set how the first output
            token decodes (a sentencepiece leading space), never emitted themselves.
    """

    def __init__(self, decode: Callable[..., str], *, skip_special_tokens: bool = True,
                 context: Sequence[int] = ()) -> None:
        self._decode, self._skip = decode, skip_special_tokens
        self.ids: list[int] = list(context)
        self._prefix, self._read = 0, len(self.ids)
        self.text = ""
        """Everything emitted so far."""

    def add(self, ids: Sequence[int]) -> str:
        """Append output ids; returns the text they complete (may be empty)."""
        self.ids.extend(ids)
        prefix_text = self._window(self._prefix, self._read)
        new_text = self._window(self._prefix, len(self.ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character (or nothing printable) so far
        return self._emit(new_text[len(prefix_text):])

    def finish(self) -> str:
        """The text still held back (a trailing incomplete character decodes as U+FFFD,
        as a full decode would show it)."""
        prefix_text = self._window(self._prefix, self._read)
        new_text = self._window(self._prefix, len(self.ids))
        return self._emit(new_text[len(prefix_text):]) if len(new_text) > len(prefix_text) \
            else ""

    def _emit(self, piece: str) -> str:
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def _window(self, start: int, end: int) -> str:
        return self._decode(self.ids[start:end], skip_special_tokens=self._skip) \
            if end > start else ""


class StopStrings:
    """Cuts a text stream at the first occurrence of any stop string.

    Args:
        stops: the stop strings (empty ones are ignored).
        include: keep the stop string itself in the output (OpenAI leaves it out).

    ``feed`` returns the text safe to show; once ``stopped`` is True the output is final.
    """

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the stream, if one did."""
        self._held = ""

    def feed(self, piece: str) -> str:
        """Add ``piece``; returns what may be emitted now (nothing after a stop)."""
        if self.stopped:
            return ""
        buf = self._held + piece
        hit = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if hit is not None:
            at, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[:at + (len(stop) if self.include else 0)]
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self) -> str:
        """The held-back tail, at the end of a stream that did not stop on a string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that begins some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if s.startswith(buf[len(buf) - k:]):
                    best = k
                    break
        return best
