"""A client of the router: submit requests, abort them, collect streamed results."""

from __future__ import annotations

import time

import zmq

from common.codec import pack_ids
from common.node import (
    Abort,
    Bye,
    Link,
    Malformed,
    Message,
    MetricsQuery,
    MetricsSnapshot,
    Shutdown,
    Status,
    StatusReport,
    Submit,
)


class Client:
    """One DEALER connection to the router.

    ``poll`` returns the router's messages: ``Tokens`` (rid, ids, first), ``Done`` (rid,
    reason, n, error, xfer_s, kv_bytes) and ``Error`` (rid, error, code) for refused
    requests and messages (``common.node.control``).
    """

    def __init__(self, address: str, name: str = "client") -> None:
        self.ctx = zmq.Context()
        self.link = Link(self.ctx, address, name)

    def submit(self, rid: str, prompt: list[int], params: dict | None = None, *,
               text: str = "", messages: list[dict[str, str]] | None = None,
               stop: list[str] | None = None) -> None:
        """Submit token ids, or (``prompt`` empty) a ``text`` prompt or chat ``messages``
        with optional ``stop`` strings; results of text requests carry text too."""
        self.link.send(Submit(rid, pack_ids(prompt) if prompt else b"", params or {},
                              text=text, messages=list(messages or []),
                              stop=list(stop or [])))

    def send(self, msg: Message) -> None:
        """Send any control message."""
        self.link.send(msg)

    def abort(self, rid: str) -> None:
        self.link.send(Abort(rid))

    def poll(self, timeout_s: float = 0.0) -> list[Message | Malformed]:
        first = self.link.recv(timeout_s)
        return [] if first is None else [first, *self.link.recv_all()]

    def request(self, msg: Message, answer: type, timeout_s: float) -> Message:
        """Send ``msg`` and wait for the first message of type ``answer``.

        Raises:
            TimeoutError: no answer within ``timeout_s``.
        """
        self.link.send(msg)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = self.link.recv(left)
            if isinstance(got, answer):
                return got
        raise TimeoutError(f"router did not answer {type(msg).__name__} within {timeout_s}s")

    def status(self, timeout_s: float = 1.0) -> StatusReport:
        return self.request(Status(), StatusReport, timeout_s)

    def metrics(self, timeout_s: float = 2.0) -> bytes:
        """The deployment's metrics (``common.metrics.loads`` + ``from_wire`` read them)."""
        snap: MetricsSnapshot = self.request(MetricsQuery(), MetricsSnapshot, timeout_s)
        return snap.families

    def shutdown(self, timeout_s: float = 30.0) -> dict:
        """Ask the router to stop every worker; returns each worker's final stats."""
        return self.shutdown_bye(timeout_s).stats

    def shutdown_bye(self, timeout_s: float = 30.0) -> Bye:
        """``shutdown``, answering the whole ``Bye`` (stats and final metrics)."""
        return self.request(Shutdown(), Bye, timeout_s)

    def close(self) -> None:
        self.link.close()
        self.ctx.term()
