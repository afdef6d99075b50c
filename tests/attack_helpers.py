"""What an attacker on the same network or host has: raw ZMQ sockets, any bytes, and
(for the stories that assume it) some of the deployment's keys. Used by test_attacks.py."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.auth import CONTROL_DOMAIN, PlaneAuth
from common.config import ServeConfig
from transport import TransportConfig
from transport.handshake import make_hello
from transport.integrity import pack_epochs
from transport.messages import ProtocolError, Register, decode, encode, pages_to_bytes

# a frame that runs code when unpickled: it creates ``marker`` (it must never exist)


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickled_exploit(marker: Path) -> bytes:
    return pickle.dumps(_Exploit(marker))


class Sock:
    """One DEALER of the attacker, with a monitor that tells how its handshake went."""

    def __init__(self, ctx: zmq.Context, address: str, plane: PlaneAuth | None = None,
                 routing_id: bytes | None = None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndtimeo = 2000   # an attacker's send must not hang the test
        if routing_id:
            self.sock.routing_id = routing_id
        self.mon = self.sock.get_monitor_socket()
        if plane is None:
            self.sock.connect(address)
        else:
            plane.connect(self.sock, address)

    def handshake(self, deadline_s: float = 30.0) -> str:
        """HANDSHAKE_SUCCEEDED or the first HANDSHAKE_FAILED_* event."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.mon.poll(100):
                ev = zmq.Event(recv_monitor_message(self.mon)["event"])
                if ev.name.startswith("HANDSHAKE"):
                    return ev.name
        raise TimeoutError("no handshake result")

    def send(self, *frames: bytes) -> bool:
        """False when the socket has no connection to send on (refused handshake)."""
        try:
            self.sock.send_multipart(list(frames))
            return True
        except zmq.Again:
            return False

    def send_map(self, body: dict) -> bool:
        return self.send(msgpack.packb(body, use_bin_type=True))

    def recv_all(self, wait_s: float = 0.3) -> list[list[bytes]]:
        """Everything that arrived within ``wait_s`` of the last message."""
        out = []
        while self.sock.poll(int(wait_s * 1000)):
            out.append(self.sock.recv_multipart())
        return out

    def recv_until(self, last, deadline_s: float = 60.0) -> list[list[bytes]]:
        """Messages until one for which ``last(parts)`` is true (a sentinel's answer:
        peers answer in order), or the deadline."""
        out = []
        deadline = time.monotonic() + deadline_s
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000)):
            out.append(self.sock.recv_multipart())
            if last(out[-1]):
                return out
        raise TimeoutError(f"no sentinel answer within {deadline_s}s; got {len(out)}")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.mon.close(0)
        self.sock.close(0)


def curve_as(pair, router_public: bytes) -> PlaneAuth:
    """CURVE credentials of any key pair, trusting the router's (public) key."""
    return PlaneAuth("curve", CONTROL_DOMAIN, pair.public, pair.secret, router_public)


SENTINEL = b"\xc1 sentinel: not msgpack"


def is_malformed_error(parts: list[bytes]) -> bool:
    """The answer to ``SENTINEL`` (or a pickle): an Error with code malformed."""
    try:
        body = msgpack.unpackb(parts[-1], raw=False)
    except Exception:
        return False
    return isinstance(body, dict) and body.get("t") == "Error" and body.get(
        "code") == "malformed"


def control_types(frames: list[list[bytes]]) -> list[tuple[str, str]]:
    """(type, code or rid) of each control answer."""
    out = []
    for parts in frames:
        body = msgpack.unpackb(parts[-1], raw=False)
        out.append((body.get("t"), body.get("code") or body.get("rid", "")))
    return out


def kv_hello(cfg: ServeConfig, node: str, digest: str, shm_pool: str = "",
             shm_pages: int = 0) -> bytes:
    """A decode's Hello on the wire that passes the layout and weights checks (all of it
    is public: ``digest`` is the fingerprint of the deployment's checkpoint), with
    whatever shared-memory fields an attacker writes: patched into the encoded map, since
    our own ``Hello`` refuses to be built with them."""
    layout = cfg.model_config().kv_layout(with_draft=cfg.with_draft)
    hello = make_hello(TransportConfig(node=node, model=cfg.model, model_digest=digest),
                       layout, cfg.page_size, "decode")
    body = msgpack.unpackb(encode(hello), raw=False)
    body.update(shm_pool=shm_pool, shm_pages=shm_pages)
    return msgpack.packb(body, use_bin_type=True)


def announce(rid: str, pages: list[int], page_size: int, cap: str = "guess") -> bytes:
    return encode(Register(rid=rid, prompt_len=len(pages) * page_size, cached_tokens=0,
                           dest_pages=pages_to_bytes(pages),
                           dest_epochs=pack_epochs(np.ones(len(pages), np.uint64)), cap=cap))


def kv_answers(frames: list[list[bytes]]) -> list[tuple[str, str]]:
    """(type, rid or code) of each KV-plane message; data frames are not messages."""
    out = []
    for parts in frames:
        try:
            msg = decode(parts[0])
        except ProtocolError as exc:
            out.append(("undecodable", exc.code.value))
            continue
        out.append((type(msg).__name__, getattr(msg, "code", "") or getattr(msg, "rid", "")))
    return out


def shm_segments(pid: int) -> list[str]:
    """Names of the /dev/shm segments process ``pid`` maps (an attacker on the host with
    the same user can read this; so can anyone who lists /dev/shm)."""
    names = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if path.startswith("/dev/shm/"):
            names.add(os.path.basename(path))
    return sorted(names)
