"""In-memory fakes of the control plane: real subclasses of ``ControlLink`` and
``ControlHub`` that carry messages without sockets, for in-process unit tests of workers
and the router. Every message goes through the real codec, so it is wire-valid."""

from __future__ import annotations

import time
from collections import Counter, deque

from common.control import (
    CODEC,
    ControlHub,
    ControlLink,
    Malformed,
    Message,
    StepTokens,
    Tokens,
)


def _wire(msg: Message) -> Message:
    return CODEC.decode(CODEC.encode(msg))


class FakeLink(ControlLink):
    """A worker's link: what it sends lands in ``sent``; ``inbox`` feeds ``recv``."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.inbox: deque[Message | Malformed] = deque()
        self.errors: Counter[str] = Counter()
        self.closed = False

    def send(self, msg: Message) -> None:
        assert not self.closed, f"send({msg}) after close"
        self.sent.append(_wire(msg))

    def recv(self, timeout_s: float = 0.0) -> Message | Malformed | None:
        return self.inbox.popleft() if self.inbox else None

    def close(self) -> None:
        self.closed = True

    def tokens(self, take: bool = False) -> list[Tokens]:
        """Every request's tokens sent so far, one ``Tokens`` per request per message, in
        order (a ``StepTokens`` carries a step's tokens of many); ``take`` removes them."""
        out = [t for m in self.sent if isinstance(m, StepTokens | Tokens)
               for t in (m.items() if isinstance(m, StepTokens) else [m])]
        if take:
            self.sent = [m for m in self.sent if not isinstance(m, StepTokens | Tokens)]
        return out

    def take(self, kind: type) -> list:
        """Remove and return the sent messages of type ``kind``, in order."""
        out = [m for m in self.sent if isinstance(m, kind)]
        self.sent = [m for m in self.sent if not isinstance(m, kind)]
        return out


class FakeHub(ControlHub):
    """The router's hub: sends land in ``sent`` as (peer, message); ``gone`` peers are
    unreachable (``send`` returns False), as a ROUTER socket reports them."""

    address = "fake://router"
    refused = 0
    """Connections refused at the handshake (none: there are none)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []
        self.inbox: deque[tuple[bytes, Message | Malformed]] = deque()
        self.errors: Counter[str] = Counter()
        self.gone: set[bytes] = set()
        self.closed = False

    def send(self, peer: bytes, msg: Message) -> bool:
        if peer in self.gone:
            return False
        self.sent.append((peer, _wire(msg)))
        return True

    def recv(self, timeout_s: float) -> tuple[bytes, Message | Malformed, str] | None:
        """(peer, message, identity): without keys, every sender's identity is ''."""
        return (*self.inbox.popleft(), "") if self.inbox else None

    def close(self, linger_s: float = 0.0) -> None:
        self.closed = True

    def take(self, peer: bytes, kind: type | None = None) -> list:
        """Remove and return what was sent to ``peer`` (of type ``kind``), in order."""
        mine = [(p, m) for p, m in self.sent
                if p == peer and (kind is None or isinstance(m, kind))]
        self.sent = [x for x in self.sent if x not in mine]
        return [m for _, m in mine]


def settle(router, timeout_s: float = 30.0) -> None:
    """Let ``router`` (in process) route every text request it is encoding: wait for the
    encoding threads, then run the loop's step that takes their results."""
    deadline = time.monotonic() + timeout_s
    while len(router.encoder):
        assert time.monotonic() < deadline, f"{len(router.encoder)} texts still encoding"
        router.encoder.wait(0.05)
        router._tick_encoded(time.monotonic())


class RouterPort:
    """The HTTP front door's port (``deploy.http.ports.Port``) to an in-process ``Router``
    over a ``FakeHub``: a send is a dispatch (through the codec), and what the router
    answers this client is delivered at once; a test plays the workers with
    ``worker_says`` (their messages, then the client's share of the answers)."""

    address = "fake://router"

    def __init__(self, router, peer: bytes = b"http-client") -> None:
        self.router, self.peer = router, peer
        self.sent: list[Message] = []
        self._deliver = None

    def attach(self, loop, deliver) -> None:
        self._deliver = deliver

    def send(self, msg: Message) -> None:
        self.sent.append(msg)
        self.router.dispatch(self.peer, _wire(msg))
        self.flush()

    def worker_says(self, worker: bytes, *msgs: Message) -> None:
        for msg in msgs:
            self.router.dispatch(worker, _wire(msg))
        self.flush()

    def flush(self) -> None:
        settle(self.router)
        if self._deliver is not None:
            for msg in self.router.hub.take(self.peer):
                self._deliver(msg)

    def detach(self) -> None:
        self._deliver = None

    def close(self) -> None:
        pass
