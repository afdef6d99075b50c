"""Handing a secret to the other processes of one worker over an authenticated channel.

Rank 0 of a tensor-parallel worker receives the KV plane's credentials from the router;
its followers need them too (their KV endpoints present them to peers), and they have no
socket to the router. The group's own connection (gloo or NCCL over TCP) authenticates
nothing, so the credentials never travel on it: rank 0 offers them on a CURVE socket
that admits exactly the identity every rank of the worker runs as (the same key pair,
``--auth-keys`` and ``--identity``), and each follower fetches them there. libzmq does
the cryptography (CURVE, libsodium), as on every other plane.

Only the offer's address crosses the group's connection; someone who reads it learns
where to knock, not what is behind the door.
"""

from __future__ import annotations

import socket
import time

import zmq

from common.auth.keys import Keys
from common.auth.planes import PlaneAuth

HANDOFF_DOMAIN = "pdkv-handoff"
_ASK = b"pdkv handoff v1"


def _plane(keys: Keys, identity: str) -> PlaneAuth:
    """Server and client are the same identity: each proves it holds the secret key."""
    me = keys.pair(identity)
    return PlaneAuth("curve", HANDOFF_DOMAIN, me.public, me.secret, me.public,
                     ((me.public, identity),))


class SecretOffer:
    """Rank 0's side: a CURVE server on ``host`` (an ephemeral port) that answers each of
    ``count`` askers once with the secret, then closes.

    Raises:
        KeysError: the key directory lacks ``identity``'s secret key.
    """

    def __init__(self, keys: Keys, identity: str, host: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 1000  # the last answer leaves before the socket closes
        try:
            ip = socket.gethostbyname(host)  # libzmq binds addresses, not host names
            self.guard = _plane(keys, identity).serve(self.sock, f"tcp://{ip}:*")
        except BaseException:
            self.sock.close(0)
            self.ctx.term()
            raise
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve(self, secret: bytes, count: int, timeout_s: float) -> None:
        """Answer ``count`` distinct askers, then close.

        Raises:
            TimeoutError: fewer asked within ``timeout_s`` (a rank died, or it holds
                another key: the handshake refused it).
        """
        answered: set[bytes] = set()
        deadline = time.monotonic() + timeout_s
        try:
            while len(answered) < count:
                left = deadline - time.monotonic()
                if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                    raise TimeoutError(f"{count - len(answered)} of {count} rank(s) did not "
                                       f"fetch the KV credentials within {timeout_s:.0f} s "
                                       "(a rank died, or runs with other keys)")
                peer, ask = self.sock.recv_multipart()
                if ask == _ASK:
                    self.sock.send_multipart([peer, secret])
                    answered.add(peer)
        finally:
            self.close()

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close()
            self.guard.close()
            self.ctx.term()


def fetch_secret(keys: Keys, identity: str, address: str, timeout_s: float) -> bytes:
    """A follower's side: the secret rank 0 offers at ``address``.

    Raises:
        TimeoutError: no answer within ``timeout_s`` (rank 0 gone, or it refused our key).
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        _plane(keys, identity).connect(sock, address)
        sock.send(_ASK)
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no KV credentials from rank 0 at {address} within "
                               f"{timeout_s:.0f} s (rank 0 gone, or it runs with other keys)")
        return sock.recv()
    finally:
        sock.close(0)
        ctx.term()
