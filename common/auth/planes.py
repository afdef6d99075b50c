"""How pdkv sockets authenticate their peers: ZMQ CURVE (or PLAIN) through pyzmq's ZAP
authenticator, and where a socket without authentication may bind.

Two planes, each with its own ``PlaneAuth``:

| plane | server | clients | keys |
| --- | --- | --- | --- |
| control | router (``Hub``) | workers, clients, operator | the key directory (keys.py) |
| KV | prefill (``RouterSocket``) | decode ranks | from the router's key, at registration |
| KV events | each worker (PUB, replay ROUTER) | routers, operators | the key directory |

A CURVE server admits exactly the client public keys it was given and tags every message
with the identity name of its sender (ZAP ``User-Id``, read by ``principal``); a client
verifies the server's public key, so both ends are authenticated and the bytes encrypted.
``plain`` (KV plane only) authenticates the connection with a per-deployment password and
leaves the bytes in the clear: for a private data network, at no encryption cost. With
``null`` (no keys) nothing is authenticated, so such a socket may bind only loopback
(``check_bind``). No cryptography is written here: libzmq does it (libsodium).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from common.auth.keys import Keys, role_of

logger = logging.getLogger(__name__)
MECHANISMS = ("null", "curve", "plain")
CONTROL_DOMAIN, KV_DOMAIN, EVENTS_DOMAIN = "pdkv-control", "pdkv-kv", "pdkv-kv-events"
KV_USER = "kv-peer"
EVENTS_SUBSCRIBERS = ("router", "operator")
"""Roles whose identities may subscribe to a worker's KV events: the deployment's router,
an operator, and an external router given an identity of its own (``router-NAME``, which
may send nothing on the control plane)."""


class InsecureBind(RuntimeError):
    """A socket without authentication asked to bind where others could reach it."""


@dataclass(frozen=True)
class PlaneAuth:
    """How one plane's sockets authenticate, in one process.

    Args:
        mechanism: ``null`` (none: loopback only), ``curve`` or ``plain``.
        domain: ZAP domain of the server socket.
        public, secret: this end's CURVE key pair (z85).
        server_public: CURVE: the server key a connecting socket trusts.
        allowed: CURVE server: admitted client public keys and their identity names.
        password: PLAIN: the shared secret (user ``kv-peer``).
    """

    mechanism: str = "null"
    domain: str = ""
    public: bytes = b""
    secret: bytes = b""
    server_public: bytes = b""
    allowed: tuple[tuple[bytes, str], ...] = ()
    password: str = ""

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism={self.mechanism!r}; allowed: {MECHANISMS}")

    @property
    def secured(self) -> bool:
        return self.mechanism != "null"

    def serve(self, sock: zmq.Socket, address: str) -> ServerGuard:
        """Make ``sock`` a server of this plane and bind it to ``address``.

        Raises:
            InsecureBind: ``null`` and ``address`` is reachable from other hosts or users.
        """
        check_bind(address, self.secured)
        guard = ServerGuard(None, self.domain)
        if self.mechanism == "curve":
            guard.zap = Zap.acquire(sock.context, self.domain, curve=dict(self.allowed))
            sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
            sock.curve_server = True
        elif self.mechanism == "plain":
            guard.zap = Zap.acquire(sock.context, self.domain, plain={KV_USER: self.password})
            sock.plain_server = True
        if self.secured:
            sock.zap_domain = self.domain.encode()
        try:
            sock.bind(address)
        except BaseException:
            guard.close()
            raise
        _restrict_ipc(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return guard

    def connect(self, sock: zmq.Socket, address: str) -> None:
        """Connect ``sock`` to a server of this plane, presenting our credentials."""
        if self.mechanism == "curve":
            sock.curve_serverkey = self.server_public
            sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        elif self.mechanism == "plain":
            sock.plain_username, sock.plain_password = KV_USER.encode(), self.password.encode()
        sock.connect(address)

    # the KV plane's credentials travel from the router to workers in `registered`
    def to_dict(self) -> dict:
        return {"mechanism": self.mechanism, "public": self.public.decode(),
                "secret": self.secret.decode(), "password": self.password}

    @classmethod
    def kv_from_dict(cls, d: dict) -> PlaneAuth:
        """The KV plane as the router described it: one shared key pair, both ends."""
        mech, pub = str(d["mechanism"]), str(d.get("public", "")).encode()
        if mech == "curve" and len(pub) != 40:
            raise ValueError(f"KV plane key of {len(pub)} characters; need 40 (z85)")
        return cls(mech, KV_DOMAIN, pub, str(d.get("secret", "")).encode(), pub,
                   ((pub, KV_USER),) if mech == "curve" else (),
                   str(d.get("password", "")))


INSECURE = PlaneAuth()


def new_kv_plane(mechanism: str) -> PlaneAuth:
    """Fresh, random KV-plane credentials (tests; a deployment's come from ``kv_plane``)."""
    return _kv_plane_from(mechanism, secrets.token_bytes(32))


def kv_plane(keys: Keys | None, mechanism: str) -> PlaneAuth:
    """A deployment's KV-plane credentials, which the router hands its workers.

    Derived from the router's secret key (HMAC-SHA256 as a key-derivation function, the
    extract-free HKDF step for a key that is uniformly random already), so a restarted
    router hands the same ones out again and its workers rejoin with their KV sockets as
    they are; new router keys (``pdkv keys create``, every ``pdkv run``) make new ones.
    """
    if keys is None:
        return INSECURE
    router_secret = z85.decode(keys.pair("router").secret)
    seed = hmac.new(router_secret, f"pdkv kv plane v1 {mechanism}".encode(),
                    hashlib.sha256).digest()
    return _kv_plane_from(mechanism, seed)


def _kv_plane_from(mechanism: str, seed: bytes) -> PlaneAuth:
    if mechanism == "curve":   # any 32 bytes are a Curve25519 secret key
        secret = z85.encode(seed)
        public = zmq.curve_public(secret)
        return PlaneAuth("curve", KV_DOMAIN, public, secret, public, ((public, KV_USER),))
    if mechanism == "plain":
        return PlaneAuth("plain", KV_DOMAIN,
                         password=base64.urlsafe_b64encode(seed).decode().rstrip("="))
    return INSECURE


def control_server(keys: Keys | None) -> PlaneAuth:
    """The router's control plane: every identity of the key directory is admitted."""
    if keys is None:
        return INSECURE
    me = keys.pair("router")
    allowed = tuple((k, n) for k, n in keys.principals().items() if n != "router")
    return PlaneAuth("curve", CONTROL_DOMAIN, me.public, me.secret, allowed=allowed)


def control_client(keys: Keys | None, name: str) -> PlaneAuth:
    """A worker's, client's or operator's control plane, as identity ``name``."""
    if keys is None:
        return INSECURE
    me = keys.pair(name)
    return PlaneAuth("curve", CONTROL_DOMAIN, me.public, me.secret, keys.public("router"))


def events_server(keys: Keys | None, identity: str) -> PlaneAuth:
    """A worker's KV events sockets (PUB and replay), as identity ``identity``: CURVE with
    its key pair, admitting the identities of role router and operator
    (``EVENTS_SUBSCRIBERS``); without keys none (loopback only)."""
    if keys is None:
        return INSECURE
    me = keys.pair(identity)
    allowed = tuple((k, n) for k, n in keys.principals().items()
                    if role_of(n) in EVENTS_SUBSCRIBERS)
    return PlaneAuth("curve", EVENTS_DOMAIN, me.public, me.secret, allowed=allowed)


def events_client(keys: Keys | None, identity: str, publisher: str) -> PlaneAuth:
    """A subscriber of a worker's KV events, as ``identity``, trusting the public key of
    the worker's identity ``publisher``; without keys none."""
    if keys is None:
        return INSECURE
    me = keys.pair(identity)
    return PlaneAuth("curve", EVENTS_DOMAIN, me.public, me.secret, keys.public(publisher))


def principal(frame: zmq.Frame) -> str:
    """The authenticated identity name of the peer that sent ``frame`` ('' for null)."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:  # no ZAP handler authenticated this connection
        return ""


class ServerGuard:
    """Holds a server socket's share of its context's authenticator; ``close`` after
    the socket is closed and before the context is terminated."""

    def __init__(self, zap: Zap | None, domain: str) -> None:
        self.zap, self.domain = zap, domain

    @property
    def refused(self) -> int:
        """Connections whose credentials were refused on this socket's domain."""
        return self.zap.refused[self.domain] if self.zap else 0

    def close(self) -> None:
        if self.zap is not None:
            self.zap.release()
            self.zap = None


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread; User-Id is the identity name, refusals are counted."""

    def __init__(self, ctx: zmq.Context, zap: Zap) -> None:
        super().__init__(ctx, log=logging.getLogger("zmq.auth"))
        self._zap = zap

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._zap.names.get(z85.encode(client_public_key), "?")

    def _authenticate_plain(self, domain: str, username: str, password: str):
        allowed, reason = super()._authenticate_plain(domain, username, password)
        if not allowed:
            self._zap.count_refusal(domain, f"PLAIN user {username!r}: {reason!r}")
        return allowed, reason


class _CurveDomain:
    def __init__(self, zap: Zap, domain: str, keys: dict[bytes, str]) -> None:
        self.zap, self.domain, self.keys = zap, domain, keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.zap.count_refusal(domain, f"unknown CURVE key {key[:8].decode()}...")
        return False


class Zap:
    """One ZAP authenticator per ZMQ context (libzmq asks the socket's own context), shared
    by the server sockets bound in it, each with its own domain and admitted peers."""

    _lock = threading.Lock()
    _by_ctx: dict[int, Zap] = {}

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx, self.users = ctx, 0
        self.names: dict[bytes, str] = {}
        self.refused: Counter[str] = Counter()
        self.auth = _Authenticator(ctx, self)
        self.auth.start()

    @classmethod
    def acquire(cls, ctx: zmq.Context, domain: str, curve: dict[bytes, str] | None = None,
                plain: dict[str, str] | None = None) -> Zap:
        with cls._lock:
            zap = cls._by_ctx.get(id(ctx))
            if zap is None:
                zap = cls._by_ctx[id(ctx)] = Zap(ctx)
            zap.users += 1
        if curve is not None:
            zap.names.update(curve)
            zap.auth.configure_curve_callback(domain, _CurveDomain(zap, domain, dict(curve)))
        if plain is not None:
            zap.auth.configure_plain(domain, plain)
        return zap

    def count_refusal(self, domain: str, why: str) -> None:
        self.refused[domain] += 1
        logger.warning("refused a connection on %s: %s", domain, why)

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users > 0:
                return
            del self._by_ctx[id(self.ctx)]
        self.auth.stop()


# -- why a server said nothing ----------------------------------------------------------
def handshake_check(auth: PlaneAuth, address: str, timeout_s: float = 3.0
                    ) -> tuple[str, str]:
    """Connect to a server of ``auth``'s plane once and say how the handshake ended:
    ``(outcome, sentence)`` with outcome ``ok``, ``refused`` (our keys refused, or keys
    missing on one side), ``stalled`` (connected, no handshake) or ``absent`` (nothing
    accepts connections there). A refused handshake is silent to the sender of a message
    (libzmq just drops the connection), so a client that heard nothing asks this to tell
    "the server refused us" from "no server"."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    mon = sock.get_monitor_socket()
    try:
        auth.connect(sock, address)
        return _handshake_outcome(mon, auth, address, time.monotonic() + timeout_s)
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def _handshake_outcome(mon: zmq.Socket, auth: PlaneAuth, address: str,
                       deadline: float) -> tuple[str, str]:
    connected = False
    while (left := deadline - time.monotonic()) > 0:
        if not mon.poll(int(left * 1000) + 1):
            break
        event = zmq.Event(recv_monitor_message(mon)["event"])
        if event == zmq.Event.HANDSHAKE_SUCCEEDED:
            return "ok", f"{address} accepted our credentials"
        connected |= event == zmq.Event.CONNECTED
        if event == zmq.Event.HANDSHAKE_FAILED_AUTH:
            return "refused", (f"{address} refused our key: its key directory has no "
                               "identity with our public key (another deployment's keys, "
                               "or a revoked identity)")
        if event.name.startswith("HANDSHAKE_FAILED"):
            if not auth.secured:
                return "refused", (f"{address} requires authentication and we have no "
                                   "keys: give --auth-keys DIR (or $PDKV_AUTH_KEYS) with "
                                   "an identity it admits")
            return "refused", (f"the handshake with {address} failed ({event.name}): it "
                               "runs without keys, or its key is not the one our key "
                               "directory names")
    if connected:
        return "stalled", f"{address} accepted the connection but never finished the handshake"
    return "absent", f"nothing accepts connections at {address}"


# -- where a socket may bind ------------------------------------------------------------
def check_bind(address: str, secured: bool) -> None:
    """Refuse an unauthenticated bind that other hosts or users could reach.

    Loopback TCP and ipc sockets under a directory only we can enter are private;
    anything else needs authentication (``--auth-keys``).
    """
    if secured:
        return
    scheme, _, rest = address.partition("://")
    if scheme == "inproc":
        return
    if scheme == "ipc":
        if _private_path(Path(rest)):
            return
        why = f"{rest} lies in directories other local users can enter"
    elif scheme == "tcp":
        host = rest.rsplit(":", 1)[0].strip("[]")
        if _is_loopback(host):
            return
        why = f"{host!r} is reachable from other hosts"
    else:
        why = f"transport {scheme!r} is not known to be private"
    raise InsecureBind(f"refusing to bind {address} without authentication: {why}. "
                       "Give the deployment keys (pdkv keys create DIR; then --auth-keys "
                       "DIR on every process), or bind 127.0.0.1 / an ipc path in a "
                       "private directory")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: not provably loopback
        return False


def _private_path(path: Path) -> bool:
    """Some directory above ``path`` is ours and closed to group and others."""
    me = os.geteuid()
    for parent in path.absolute().parents:
        try:
            st = parent.stat()
        except OSError:
            return False
        if st.st_uid == me and not stat.S_IMODE(st.st_mode) & 0o077:
            return True
    return False


def _restrict_ipc(endpoint: str) -> None:
    """An ipc socket file is connectable by whoever may write it: only us."""
    if endpoint.startswith("ipc://"):
        try:
            os.chmod(endpoint[len("ipc://"):], 0o600)
        except OSError as exc:
            logger.warning("cannot restrict %s: %s", endpoint, exc)
