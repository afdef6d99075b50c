"""Roles on the control plane (deploy/router/roles.py, the router's checks): a router with a key
directory in this process, peers on real CURVE sockets, each authenticated as an identity
of the deployment (or of another one). Process-level attack stories: tests/test_attacks.py.
"""

from __future__ import annotations

import time

import pytest
import zmq

from common.auth import Keys, PlaneAuth, control_client, create_keys
from common.config import ServeConfig
from common.control import (
    CODEC,
    Abort,
    Done,
    Error,
    Link,
    Ready,
    Register,
    Registered,
    Req,
    Shutdown,
    Status,
    StatusReport,
    Submit,
    Tokens,
    pack_ids,
    unpack_ids,
)
from deploy.router.router import Router


@pytest.fixture
def keys(tmp_path) -> Keys:
    create_keys(tmp_path / "keys", clients=["client-alice", "client-bob"])
    return Keys(tmp_path / "keys")


@pytest.fixture
def router(tmp_path, keys):
    r = Router("tcp://127.0.0.1:*", ServeConfig(page_size=4, kv_security="plain"), keys)
    yield r
    for link in getattr(r, "_test_links", []):
        link.close()
    r.hub.close()
    r.ctx.term()


def _link(router: Router, keys: Keys, identity: str, name: str | None = None) -> Link:
    link = Link(router.ctx, router.address, name or identity, control_client(keys, identity))
    router.__dict__.setdefault("_test_links", []).append(link)
    return link


def _pump(router: Router, n: int = 1) -> None:
    """Let the router take ``n`` messages (the handshake may take a moment)."""
    for _ in range(n):
        item = router.hub.recv(30.0)
        assert item is not None, "the router got nothing"
        router.dispatch(*item)


def _answer(link: Link, kind: type | None = None, timeout_s: float = 30.0):
    got = link.recv(timeout_s)
    assert got is not None, "no answer"
    assert kind is None or isinstance(got, kind), got
    return got


def _register(router, keys, name: str, role: str, kv_addr: str = "") -> Link:
    link = _link(router, keys, "worker", name)
    link.send(Register(role, name, 1, keys.deployment_id))
    _pump(router)
    reg = _answer(link, Registered)
    assert reg.deployment == keys.deployment_id and reg.kv_auth["mechanism"] == "plain"
    link.send(Ready(name, kv_addr, 1000))
    _pump(router)
    return link


def _forbidden(router, link, msg, counter: str) -> Error:
    before = router.errors[counter]
    link.send(msg)
    _pump(router)
    err = _answer(link, Error)
    assert err.code == "forbidden", err
    assert router.errors[counter] == before + 1
    return err


@pytest.fixture
def deployment(router, keys):
    """A registered prefill and decode, and alice's request r1 routed to them."""
    p = _register(router, keys, "p0", "prefill", "tcp://127.0.0.1:1")
    d = _register(router, keys, "d0", "decode")
    alice = _link(router, keys, "client-alice")
    alice.send(Submit("r1", pack_ids([1, 2, 3]), {"max_new_tokens": 4}))
    _pump(router)
    req_d, req_p = _answer(d, Req), _answer(p, Req)
    assert req_d.cap == req_p.cap and len(req_d.cap) == 32   # 128 random bits, both sides
    admitted = _answer(alice, Tokens)                        # the door let it in
    assert (admitted.rid, admitted.ids, admitted.prompt_tokens) == ("r1", [], 3)
    return p, d, alice, req_d


def test_only_an_operator_may_shut_down(router, keys):
    alice = _link(router, keys, "client-alice")
    _forbidden(router, alice, Shutdown(), "forbidden.Shutdown")
    worker = _link(router, keys, "worker")
    _forbidden(router, worker, Shutdown(), "forbidden.Shutdown")
    assert router.shutdown_by is None
    op = _link(router, keys, "operator")
    op.send(Shutdown())
    _pump(router)
    assert router.shutdown_by is not None


def test_only_workers_of_this_deployment_may_register(router, keys):
    alice = _link(router, keys, "client-alice")
    _forbidden(router, alice, Register("decode", "evil", 1, keys.deployment_id),
               "forbidden.Register")
    stale = _link(router, keys, "worker", "stale")
    err = _forbidden(router, stale, Register("decode", "stale", 1, "0" * 32),
                     "forbidden.Register")
    assert "--auth-keys" in err.error
    assert router.workers == {}


def test_workers_may_not_submit_and_clients_may_not_speak_for_workers(router, keys,
                                                                      deployment):
    _, d, alice, req = deployment
    _forbidden(router, d, Submit("w1", pack_ids([1]), {}), "forbidden.Submit")
    _forbidden(router, alice, Tokens(req.rid, [7]), "forbidden.Tokens")
    _forbidden(router, alice, Done(req.rid, "length", n=4), "forbidden.Done")
    assert alice.recv(0.2) is None   # no forged token reached the owner
    route = router.routes.get(req.rid)
    assert route is not None and route.decode_done is None


def test_a_worker_reports_only_on_requests_it_was_given(router, keys, deployment):
    p, d, alice, req = deployment
    evil = _register(router, keys, "d1", "decode")   # a worker of the deployment, not r1's
    _forbidden(router, evil, Tokens(req.rid, [66]), "forbidden.Tokens")
    _forbidden(router, evil, Done(req.rid, "stop", n=1), "forbidden.Done")
    _forbidden(router, p, Tokens(req.rid, [66]), "forbidden.Tokens")   # r1's prefill
    assert alice.recv(0.2) is None
    d.send(Tokens(req.rid, [5], first=True))     # r1's own decode is relayed
    _pump(router)
    got = _answer(alice, Tokens)
    assert got.rid == "r1" and got.ids == [5]    # under alice's label


def test_a_client_aborts_only_its_own_requests(router, keys, deployment):
    p, d, alice, req = deployment
    bob = _link(router, keys, "client-bob")
    for rid in ("r1", req.rid):   # alice's label, and the router's id had bob learned it
        bob.send(Abort(rid))
        _pump(router)
        # a client's rids name only its own requests: bob learns nothing about alice's
        assert _answer(bob, Error).code == "unknown_rid"
    assert d.recv(0.2) is None and p.recv(0.2) is None
    alice.send(Abort("r1"))
    _pump(router)
    assert _answer(d, Abort).rid == req.rid and _answer(p, Abort).rid == req.rid


def test_an_operator_may_abort_any_request(router, keys, deployment):
    p, d, _, req = deployment
    op = _link(router, keys, "operator")
    op.send(Abort(req.rid))   # by the router's id (logs and free logs name it)
    _pump(router)
    assert _answer(d, Abort).rid == req.rid


def test_a_routing_id_stays_with_the_identity_that_first_used_it(router, keys):
    def raw(identity: str) -> zmq.Socket:
        sock = router.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.routing_id = b"worker/shared-id"
        control_client(keys, identity).connect(sock, router.address)
        return sock

    first = raw("client-alice")
    first.send(CODEC.encode(Status()))
    _pump(router)
    assert isinstance(CODEC.decode(first.recv()), StatusReport)
    first.close(0)
    # the router refuses a second connection under a live routing id (no handover): let
    # it see alice's connection go first (its hub watches every connection close)
    deadline = time.monotonic() + 30
    while not router.hub.take_disconnects():
        assert time.monotonic() < deadline, "the router did not see alice disconnect"
        router.hub.recv(0.05)
    # another identity, reconnecting under that routing id; the router forgets alice's
    # pipe only after its own thread took her disconnect, so under load bob's first
    # connection may still meet her id and be dropped unheard: connect again then
    for _ in range(15):
        second = raw("client-bob")
        try:
            second.send(CODEC.encode(Status()))
            item = router.hub.recv(2.0)
            if item is None:
                continue
            router.dispatch(*item)
            err = CODEC.decode(second.recv())
            assert isinstance(err, Error) and err.code == "forbidden", err
            break
        finally:
            second.close(0)
    else:
        raise AssertionError("the router never heard bob under alice's old routing id")


def test_status_counts_refused_messages_and_connections(router, keys, tmp_path):
    from zmq.utils.monitor import recv_monitor_message

    create_keys(tmp_path / "other")
    foreign = Keys(tmp_path / "other").pair("client")   # another deployment's client key
    stranger = Link(router.ctx, router.address, "stranger", PlaneAuth(
        "curve", "pdkv-control", foreign.public, foreign.secret, keys.public("router")))
    router.__dict__.setdefault("_test_links", []).append(stranger)
    mon = stranger.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:   # the handshake starts at connect: nothing needs to be sent
        assert mon.poll(30000), "the stranger's handshake did not fail"
        recv_monitor_message(mon)
    finally:
        mon.close(0)
    alice = _link(router, keys, "client-alice")
    _forbidden(router, alice, Shutdown(), "forbidden.Shutdown")
    alice.send(Status())
    _pump(router)
    report = _answer(alice, StatusReport)
    assert report.errors["forbidden"] == 1 and report.errors["forbidden.Shutdown"] == 1
    assert report.errors["unauthenticated"] == 1
    assert stranger.recv(0.2) is None


def test_prompts_reach_only_the_assigned_workers(router, keys, deployment):
    p, d, _, req = deployment
    assert unpack_ids(req.prompt).tolist() == [1, 2, 3]
    bystander = _register(router, keys, "d9", "decode")
    assert bystander.recv(0.2) is None
