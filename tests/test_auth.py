"""Key directories and socket authentication (common/auth/keys.py, auth.py) on real sockets."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.auth import InsecureBind, PlaneAuth, check_bind, keys
from common.auth import planes as auth


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def keydir(tmp_path) -> Path:
    keys.create(tmp_path / "keys", clients=["client", "client-alice"])
    return tmp_path / "keys"


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()   # hangs (test timeout) if a socket or an authenticator was left open


def _handshake_failure(sock: zmq.Socket, mon: zmq.Socket, deadline_s: float = 20.0) -> str:
    """The first handshake failure event the client's monitor reports (or a timeout)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if mon.poll(100):
            ev = zmq.Event(recv_monitor_message(mon)["event"])
            if ev.name.startswith("HANDSHAKE_FAILED"):
                return ev.name
            if ev == zmq.Event.HANDSHAKE_SUCCEEDED:
                return ev.name
    raise TimeoutError("no handshake result")


class Server:
    """A ROUTER bound with ``plane``; ``recv`` returns (principal, payload)."""

    def __init__(self, ctx, plane: PlaneAuth):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.guard = plane.serve(self.sock, "tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_ms: int = 20000):
        if not self.sock.poll(timeout_ms):
            return None
        peer, data = self.sock.recv_multipart(copy=False)
        return auth.principal(data), data.bytes

    def close(self):
        self.sock.close(0)
        self.guard.close()


def _client(ctx, plane: PlaneAuth | None, address: str):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    mon = sock.get_monitor_socket()
    if plane is None:
        sock.connect(address)
    else:
        plane.connect(sock, address)
    return sock, mon


def _send_unchecked(sock: zmq.Socket, data: bytes) -> None:
    """Send on a client whose handshake is about to fail: once it failed, ZMQ drops the
    connection's queue and a DEALER has none left, so a blocking send would wait forever
    (``zmq.Again`` without blocking: nothing was sent, as the test wants)."""
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _close(*socks):
    for s in socks:
        s.close(0)


# -- key directories ---------------------------------------------------------------------
def test_create_writes_private_secrets_and_a_deployment_id(keydir):
    meta = json.loads((keydir / "deployment.json").read_text())
    assert meta["format"] == "pdkv-keys" and len(meta["deployment_id"]) == 32
    assert _mode(keydir) == 0o700
    for name in ("router", "worker", "operator", "client", "client-alice"):
        assert _mode(keydir / f"{name}.key_secret") == 0o600
        assert b"secret-key" not in (keydir / f"{name}.key").read_bytes()
    k = keys.Keys(keydir)
    assert k.deployment_id == meta["deployment_id"]
    assert k.names() == ["client", "client-alice", "operator", "probe", "router", "worker"]
    assert len(set(k.principals())) == 6   # six distinct public keys


def test_two_deployments_never_share_ids_or_keys(tmp_path):
    a, b = keys.create(tmp_path / "a"), keys.create(tmp_path / "b")
    assert a != b
    assert keys.Keys(tmp_path / "a").public("worker") != keys.Keys(tmp_path / "b").public(
        "worker")


def test_keys_are_never_overwritten_and_names_are_checked(keydir):
    with pytest.raises(keys.KeysError, match="not empty"):
        keys.create(keydir)
    with pytest.raises(keys.KeysError, match="exists already"):
        keys.add(keydir, "worker")
    with pytest.raises(ValueError, match="identity name"):
        keys.add(keydir, "../evil")
    with pytest.raises(ValueError, match="identity name"):
        keys.add(keydir, "admin")
    assert keys.add(keydir, "worker-host3").name == "worker-host3"
    assert keys.role_of("worker-host3") == "worker"


def test_a_secret_readable_by_others_is_refused(keydir):
    os.chmod(keydir / "worker.key_secret", 0o644)
    with pytest.raises(keys.KeysError, match="chmod 600"):
        keys.Keys(keydir).pair("worker")


def test_export_copies_only_the_secrets_a_host_needs(keydir, tmp_path):
    keys.export(keydir, ["worker"], tmp_path / "w")
    out = tmp_path / "w"
    assert sorted(p.name for p in out.glob("*.key_secret")) == ["worker.key_secret"]
    assert _mode(out) == 0o700 and _mode(out / "worker.key_secret") == 0o600
    k = keys.Keys(out)
    assert k.pair("worker").secret == keys.Keys(keydir).pair("worker").secret
    with pytest.raises(keys.KeysError, match="no secret key for 'router'"):
        k.pair("router")


def test_a_directory_without_deployment_json_says_how_to_make_one(tmp_path):
    with pytest.raises(keys.KeysError, match="pdkv keys create"):
        keys.Keys(tmp_path)


# -- the control plane: CURVE with identities ---------------------------------------------
def test_curve_peers_are_known_by_identity_name(keydir, ctx):
    k = keys.Keys(keydir)
    server = Server(ctx, auth.control_server(k))
    a, mon_a = _client(ctx, auth.control_client(k, "client-alice"), server.address)
    w, mon_w = _client(ctx, auth.control_client(k, "worker"), server.address)
    try:
        a.send(b"from alice")
        w.send(b"from worker")
        got = {server.recv(), server.recv()}
        assert got == {("client-alice", b"from alice"), ("worker", b"from worker")}
        assert server.guard.refused == 0
    finally:
        _close(a, mon_a, w, mon_w)
        server.close()


def test_an_unauthenticated_socket_gets_nothing_through(keydir, ctx):
    server = Server(ctx, auth.control_server(keys.Keys(keydir)))
    sock, mon = _client(ctx, None, server.address)   # NULL mechanism, no keys at all
    try:
        _send_unchecked(sock, b"shutdown")
        assert _handshake_failure(sock, mon) == "HANDSHAKE_FAILED_PROTOCOL"
        assert server.recv(timeout_ms=200) is None
    finally:
        _close(sock, mon)
        server.close()


def test_an_unknown_key_is_refused_and_counted(keydir, ctx, tmp_path):
    k = keys.Keys(keydir)
    server = Server(ctx, auth.control_server(k))
    keys.create(tmp_path / "other")   # another deployment's worker key
    foreign = keys.Keys(tmp_path / "other").pair("worker")
    plane = PlaneAuth("curve", auth.CONTROL_DOMAIN, foreign.public, foreign.secret,
                      k.public("router"))
    sock, mon = _client(ctx, plane, server.address)
    try:
        _send_unchecked(sock, b"register")
        assert _handshake_failure(sock, mon) == "HANDSHAKE_FAILED_AUTH"
        assert server.recv(timeout_ms=200) is None
        assert server.guard.refused == 1
    finally:
        _close(sock, mon)
        server.close()


def test_a_client_refuses_a_server_with_the_wrong_key(keydir, ctx, tmp_path):
    keys.create(tmp_path / "other")
    impostor = Server(ctx, auth.control_server(keys.Keys(tmp_path / "other")))
    sock, mon = _client(ctx, auth.control_client(keys.Keys(keydir), "worker"),
                        impostor.address)
    try:
        _send_unchecked(sock, b"register")   # would carry the worker's secrets to the impostor
        assert _handshake_failure(sock, mon).startswith("HANDSHAKE_FAILED")
        assert impostor.recv(timeout_ms=200) is None
    finally:
        _close(sock, mon)
        impostor.close()


# -- the KV plane: credentials from the router -----------------------------------------
@pytest.mark.parametrize("mechanism", ["curve", "plain"])
def test_kv_plane_credentials_round_trip_and_authenticate(ctx, mechanism):
    made = auth.new_kv_plane(mechanism)
    handed = PlaneAuth.kv_from_dict(json.loads(json.dumps(made.to_dict())))
    assert handed == made
    server = Server(ctx, handed)
    ok, mon_ok = _client(ctx, handed, server.address)
    stranger = auth.new_kv_plane(mechanism)   # another run's credentials
    if mechanism == "curve":   # public keys are public: the stranger knows the server's
        stranger = PlaneAuth("curve", auth.KV_DOMAIN, stranger.public, stranger.secret,
                             made.public)
    bad, mon_bad = _client(ctx, stranger, server.address)
    try:
        ok.send(b"hello")
        assert server.recv() == (auth.KV_USER, b"hello")
        _send_unchecked(bad, b"hello")
        assert _handshake_failure(bad, mon_bad).startswith("HANDSHAKE_FAILED")
        assert server.recv(timeout_ms=200) is None
        assert server.guard.refused == 1
    finally:
        _close(ok, mon_ok, bad, mon_bad)
        server.close()


@pytest.mark.parametrize("mechanism", ["curve", "plain"])
def test_a_deployments_kv_plane_comes_from_its_router_key(keydir, tmp_path, ctx, mechanism):
    mine = auth.kv_plane(keys.Keys(keydir), mechanism)
    again = auth.kv_plane(keys.Keys(keydir), mechanism)   # a restarted router
    assert mine == again and mine.mechanism == mechanism
    keys.create(tmp_path / "other")
    other = auth.kv_plane(keys.Keys(tmp_path / "other"), mechanism)
    assert other != mine and auth.kv_plane(keys.Keys(keydir), "plain" if mechanism ==
                                           "curve" else "curve") != mine
    assert auth.kv_plane(None, mechanism) == auth.INSECURE
    server = Server(ctx, mine)
    ok, mon = _client(ctx, again, server.address)   # derived keys make a real handshake
    try:
        ok.send(b"hello")
        assert server.recv() == (auth.KV_USER, b"hello")
    finally:
        _close(ok, mon)
        server.close()


def test_two_servers_share_one_authenticator_per_context(keydir, ctx):
    k = keys.Keys(keydir)
    control, kv = Server(ctx, auth.control_server(k)), Server(ctx, auth.new_kv_plane("curve"))
    assert control.guard.zap is kv.guard.zap
    control.close()
    w, mon = _client(ctx, None, kv.address)   # the KV server still authenticates
    try:
        assert _handshake_failure(w, mon) == "HANDSHAKE_FAILED_PROTOCOL"
    finally:
        _close(w, mon)
        kv.close()


def test_kv_credentials_of_a_bad_length_are_refused():
    with pytest.raises(ValueError, match="z85"):
        PlaneAuth.kv_from_dict({"mechanism": "curve", "public": "short", "secret": "x"})
    with pytest.raises(ValueError, match="mechanism"):
        PlaneAuth(mechanism="tls")


# -- where an unauthenticated socket may bind -----------------------------------------------
@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://127.0.0.2:*",
                                     "tcp://[::1]:5555", "tcp://localhost:5555",
                                     "inproc://x"])
def test_loopback_binds_need_no_keys(address):
    check_bind(address, secured=False)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://*:5555",
                                     "tcp://10.1.2.3:5555", "tcp://eth0:5555",
                                     "tcp://router-host:5555", "tcp://[::]:5555"])
def test_reachable_binds_are_refused_without_keys(address):
    with pytest.raises(InsecureBind, match="--auth-keys"):
        check_bind(address, secured=False)
    check_bind(address, secured=True)


def test_ipc_without_keys_only_in_a_private_directory(tmp_path):
    private = tempfile.mkdtemp()          # 0700, ours
    shared = tempfile.mkdtemp()
    os.chmod(shared, 0o755)
    try:
        check_bind(f"ipc://{private}/r.sock", secured=False)
        with pytest.raises(InsecureBind, match="other local users"):
            check_bind(f"ipc://{shared}/r.sock", secured=False)
    finally:
        os.rmdir(private)
        os.rmdir(shared)


def test_a_bound_ipc_socket_is_closed_to_others(ctx, tmp_path):
    sock = ctx.socket(zmq.ROUTER)
    guard = auth.INSECURE.serve(sock, f"ipc://{tmp_path}/r.sock")
    try:
        assert _mode(tmp_path / "r.sock") == 0o600
    finally:
        sock.close(0)
        guard.close()


def test_an_insecure_serve_refuses_before_binding(ctx):
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(InsecureBind):
            auth.INSECURE.serve(sock, "tcp://0.0.0.0:*")
        assert sock.getsockopt_string(zmq.LAST_ENDPOINT) == ""
    finally:
        sock.close(0)


# -- pdkv keys -----------------------------------------------------------------------------
def test_pdkv_keys_create_add_export_show(tmp_path, capsys):
    from deploy.cli import main

    d, out = tmp_path / "k", tmp_path / "host"
    assert main(["keys", "create", str(d), "--client", "client-web"]) == 0
    assert "--auth-keys" in capsys.readouterr().out
    assert main(["keys", "add", str(d), "worker-host3"]) == 0
    assert main(["keys", "export", str(d), str(out), "--for", "worker-host3"]) == 0
    capsys.readouterr()
    assert main(["keys", "show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["deployment_id"] == keys.Keys(d).deployment_id
    assert shown["identities"] == {"client-web": False, "operator": False, "probe": False,
                                   "router": False, "worker": False, "worker-host3": True}
    assert main(["keys", "create", str(d)]) == 2    # never overwritten
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["router", "--bind", "tcp://0.0.0.0:0"],
    ["prefill", "--router", "tcp://127.0.0.1:9", "--kv-bind", "tcp://0.0.0.0:0"],
])
def test_a_process_without_keys_refuses_a_public_bind_at_once(argv):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PDKV_AUTH_KEYS"}
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", *argv], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to bind tcp://0.0.0.0:0 without authentication" in proc.stderr
    assert "--auth-keys" in proc.stderr
