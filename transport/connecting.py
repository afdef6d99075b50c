"""A prefill group's handshake under way, on the decode side; nothing here waits.

``ReceiverLink.begin`` opens one DEALER per rank of the group and sends each our
``Hello``; every poll then takes what the ranks answered (``Connecting.step``) until each
rank's ``Hello`` matched ours (the group joins), one rank refused or differs
(``HandshakeError``), or the deadline passed (``TimeoutError``). A prefill that is dead,
stopped or slow to answer therefore costs only the requests that wait for it, never the
decode's loop: its other requests, its heartbeats to the router and its other prefills
keep going meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from . import handshake
from .messages import Error, Hello, ProtocolError, decode
from .sockets import DealerSocket


@dataclass
class Connecting:
    """One group's handshake: its ranks' sockets, the ``Hello``s that came back, the
    deadline."""

    addresses: list[str]
    socks: list[DealerSocket]
    deadline: float
    timeout_s: float
    hellos: dict[int, Hello] = field(default_factory=dict)
    """Index of a rank in ``socks`` -> its ``Hello`` (checked against ours)."""

    def step(self, ours: Hello, now: float) -> bool:
        """Take what the ranks sent (never waits); True once every rank answered.

        Raises:
            HandshakeError: a rank refused us, answered garbage, or differs from us.
            TimeoutError: ``now`` is past the deadline with a rank still silent.
        """
        for i, (address, sock) in enumerate(zip(self.addresses, self.socks)):
            while (frames := sock.recv_nowait()) is not None:
                # after its Hello a rank sends only heartbeats until we announce: the
                # rank's lease starts when the group joins, so they can go
                theirs = answer(ours, address, frames)
                if theirs is not None and i not in self.hellos:
                    self.hellos[i] = theirs
        if len(self.hellos) == len(self.socks):
            return True
        if now >= self.deadline:
            silent = next(a for i, a in enumerate(self.addresses) if i not in self.hellos)
            raise TimeoutError(f"{silent}: no Hello within {self.timeout_s}s (handshake_timeout_s;"
                               " a live peer answers between its forward passes: raise it "
                               "if those take longer under load)")
        return False

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for any rank to answer (the blocking ``connect``)."""
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock.sock, zmq.POLLIN)
        poller.poll(max(0, int(timeout_s * 1000)) + 1)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def answer(ours: Hello, address: str, frames: list[zmq.Frame]) -> Hello | None:
    """The rank's ``Hello`` in ``frames`` once checked against ours; None for anything
    else it may send meanwhile (heartbeats).

    Raises:
        HandshakeError: the answer is not a message, is an ``Error``, or differs from us.
    """
    try:
        msg = decode(frames[0].buffer)
    except ProtocolError as exc:
        raise handshake.HandshakeError(f"{address}: bad handshake answer: {exc}",
                                       "answer") from None
    if isinstance(msg, Error):
        raise handshake.HandshakeError(f"{address}: {msg.code}: {msg.detail}", "peer_refused")
    if not isinstance(msg, Hello):
        return None
    handshake.check(ours, msg)
    if msg.shm_pool not in ("", ours.shm_pool):
        raise handshake.HandshakeError(f"{address}: prefill maps pool {msg.shm_pool!r}, "
                                       f"we offered {ours.shm_pool!r}", "shm_pool")
    return msg
