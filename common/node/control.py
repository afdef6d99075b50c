"""Control messages between clients, the router and workers (not the KV transport).

Every message is one msgpack map with a type key ``"t"``; token-id lists travel as
little-endian int32 bytes (``pack_ids``). The router binds one ROUTER socket; workers and
clients each connect one DEALER. Nothing is pickled.

| t | from -> to | keys |
| --- | --- | --- |
| register | worker -> router | role, name, kv_addr, pool_tokens, vocab_size, pid |
| registered | router -> worker | config (dict), prefills ({name: kv_addr}) |
| submit | client -> router | rid, prompt (ids), params (dict) |
| abort | client -> router -> workers | rid |
| req | router -> worker | rid, prompt, params, prefill, prefill_addr, decode |
| tokens | worker -> router -> client | rid, ids, (first) |
| done | worker -> router -> client | rid, reason, n, (xfer_s, kv_bytes, error) |
| error | router -> client | rid, error |
| load | worker -> router | name, running, queued, free_tokens (also a heartbeat) |
| ping / pong | router <-> worker, client -> router | (status in pong to a client) |
| shutdown | client -> router -> workers | |
| stats | worker -> router -> client | name, stats (dict) |
"""

from __future__ import annotations

import logging
import uuid

import msgpack
import numpy as np
import zmq

logger = logging.getLogger(__name__)


def pack_ids(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: bytes) -> dict:
    msg = msgpack.unpackb(data, raw=False)
    if not isinstance(msg, dict) or "t" not in msg:
        raise ValueError(f"control message without a type: {str(msg)[:80]}")
    return msg


class Link:
    """A DEALER connected to the router: send/recv one message with a timeout, close."""

    def __init__(self, ctx: zmq.Context, address: str, name: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"{name}/{uuid.uuid4().hex[:6]}".encode())
        self.sock.connect(address)

    def send(self, msg: dict) -> None:
        self.sock.send(encode(msg))

    def recv(self, timeout_s: float = 0.0) -> dict | None:
        """The next message, or ``None`` when none came within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        return decode(self.sock.recv())

    def recv_all(self) -> list[dict]:
        out = []
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


class Hub:
    """The router's ROUTER socket: messages keyed by the sender's routing id."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(address)
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, peer: bytes, msg: dict) -> bool:
        """False when the peer is gone (the caller decides what that means)."""
        try:
            self.sock.send_multipart([peer, encode(msg)])
            return True
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False

    def recv(self, timeout_s: float) -> tuple[bytes, dict] | None:
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        peer, data = self.sock.recv_multipart()
        try:
            return peer, decode(data)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
            logger.warning("router: undecodable message from %r: %s", peer, exc)
            return peer, {"t": "invalid", "error": str(exc)}

    def close(self) -> None:
        self.sock.close(linger=0)


def wait_any(socks: list[zmq.Socket], timeout_s: float) -> bool:
    """Block until one of ``socks`` is readable or ``timeout_s`` passed."""
    if timeout_s <= 0:
        return False
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    return bool(poller.poll(int(timeout_s * 1000)))
