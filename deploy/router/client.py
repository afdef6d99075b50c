"""A client of the router: submit requests, abort them, collect streamed results."""

from __future__ import annotations

import time

import zmq

from common.auth import Keys, control_client
from common.control import (
    Abort,
    Bye,
    Error,
    Link,
    Malformed,
    Message,
    MetricsQuery,
    MetricsSnapshot,
    Ping,
    Pong,
    Shutdown,
    Status,
    StatusReport,
    Submit,
    pack_ids,
)


class Client:
    """One DEALER connection to the router.

    ``poll`` returns the router's messages: ``Tokens`` (rid, ids, first, text; a
    request's first has no ids: its door let it in, ``prompt_tokens``), ``Done`` (rid,
    reason, n, error, xfer_s, kv_bytes, text) and ``Error`` (rid, error, code, param) for
    refused requests and messages (``common.control.messages``; the parameters a
    ``submit`` takes: ``deploy.router.params``, docs/http.md).

    Args:
        address: the router's address.
        name: prefix of the connection's routing id (the router's logs).
        keys: the deployment's key directory (CURVE); None: no keys (loopback routers).
        identity: the identity to authenticate as: a ``client`` (submit, abort its own
            requests, status) or an ``operator`` (also shutdown and any abort).
    """

    def __init__(self, address: str, name: str = "client", keys: Keys | None = None,
                 identity: str = "client") -> None:
        self.address = address
        self.ctx = zmq.Context()
        self.keyed = keys is not None
        try:
            self.link = Link(self.ctx, address, name, control_client(keys, identity))
        except BaseException:
            self.ctx.term()
            raise
        self.last_heard = time.monotonic()
        """When the router last said anything (its liveness, as the client sees it)."""
        self.run = ""
        """The router incarnation its ``Pong`` last named (a change: it restarted)."""
        self._last_ping = 0.0
        self._asked = 0
        self._backlog: list[Message | Malformed] = []

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
        """The router's messages (those that ``request`` set aside first)."""
        if self._backlog:
            out, self._backlog = self._backlog + self.link.recv_all(), []
        elif (first := self.link.recv(timeout_s)) is None:
            return []
        else:
            out = [first, *self.link.recv_all()]
        self.last_heard = time.monotonic()
        for msg in out:
            if isinstance(msg, Pong):
                self.run = msg.run
        return out

    def ping(self, timeout_s: float = 10.0) -> str:
        """Ask the router for a ``Pong``; returns its incarnation tag (``run``)."""
        self.run = self.request(Ping(self._nonce()), Pong, timeout_s).run
        return self.run

    def keep_alive(self, heartbeat_s: float) -> float:
        """Ping the router when it said nothing for ``heartbeat_s`` (its ``Pong`` proves
        it alive); returns the seconds since it last said anything."""
        now = time.monotonic()
        if now - max(self.last_heard, self._last_ping) >= heartbeat_s:
            self.link.send(Ping())
            self._last_ping = now
        return now - self.last_heard

    def request(self, msg: Message, answer: type, timeout_s: float
                ) -> Message:
        """Send ``msg`` and wait for its answer (of type ``answer``, the same ``nonce``);
        an answer to an earlier ask that timed out is dropped, anything else is kept for
        the next ``poll``.

        Raises:
            TimeoutError: no answer within ``timeout_s``.
            PermissionError: the router refused ``msg`` for our identity.
        """
        self.link.send(msg)
        nonce = getattr(msg, "nonce", None)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = self.link.recv(left)
            if got is None:
                continue
            self.last_heard = time.monotonic()
            if isinstance(got, answer):
                if nonce is None or got.nonce == nonce:
                    return got
            elif isinstance(got, Error) and got.code == "forbidden" and not got.rid:
                raise PermissionError(f"router refused {type(msg).__name__}: {got.error}")
            else:
                self._backlog.append(got)
        hint = "" if self.keyed else (" (we have no keys: a router started with --auth-keys "
                                      "answers nothing to us)")
        raise TimeoutError(f"the router at {self.address} did not answer "
                           f"{type(msg).__name__} within {timeout_s}s; is it running?{hint}")

    def status(self, timeout_s: float = 1.0) -> StatusReport:
        return self.request(Status(self._nonce()), StatusReport, timeout_s)

    def _nonce(self) -> int:
        self._asked += 1
        return self._asked

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
