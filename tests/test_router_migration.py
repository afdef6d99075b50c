"""The router moves a request whose worker died, message by message (fake hub, no
workers): the next attempt's prompt carries the tokens already streamed, the client's
stream goes on without an error or a repeated token, the last attempt's live workers
free it ``migrated``, and late words about it are dropped quietly."""

from __future__ import annotations

import pytest

from common.config import ServeConfig
from common.control import (
    Abort,
    Done,
    Drain,
    Error,
    Prefilled,
    Ready,
    Register,
    Registered,
    Req,
    Shutdown,
    StatusReport,
    Submit,
    Tokens,
    pack_ids,
    unpack_ids,
)
from common.metrics import render_snapshot
from deploy.router.router import Router
from tests.fakes import FakeHub
from tests.metrics_helpers import by, parse

CFG = ServeConfig(page_size=4, decode_pages=101, prefill_pages=51, heartbeat_s=0.5,
                  lease_s=3.0)
CLIENT = b"client"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture
def router():
    r = Router(FakeHub(), CFG)
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"),
                       ("d1", "decode")):
        r.dispatch(name.encode(), Register(role, name, 100))
        assert isinstance(r.hub.take(name.encode())[0], Registered)
        r.dispatch(name.encode(), Ready(name, f"ipc:///{name}" if role == "prefill" else "",
                                        400 if role == "decode" else 200))
    yield r
    r.hub.close()
    r.ctx.term()


def _submit(r: Router, **params) -> Req:
    r.dispatch(CLIENT, Submit("a", pack_ids(PROMPT), {"max_new_tokens": 6, **params}))
    (req,) = r.hub.take(b"d0", Req)
    assert r.hub.take(b"p0", Req) == [req]
    return req


def _submit_to(r: Router, decode: str) -> Req:
    """Submit "a"; its Req as ``decode`` got it (whichever prefill took it)."""
    r.dispatch(CLIENT, Submit("a", pack_ids(PROMPT), {"max_new_tokens": 6}))
    (req,) = r.hub.take(decode.encode(), Req)
    return req


def _die(r: Router, name: str) -> None:
    """``name``'s process is gone: the next send to it finds out (as the ROUTER does)."""
    r.hub.gone.add(name.encode())
    r._send_worker(name, Abort("probe"))
    assert r.workers[name].lost


def _stream(r: Router, keep_done: bool = False) -> list[tuple[list[int], bool]]:
    """What the client got since the last look: each token message's (ids, first); the
    router's word that it let the request in (a message without ids) is left out."""
    got = r.hub.take(CLIENT, Tokens)
    assert keep_done or not r.hub.take(CLIENT, Done)
    return [(m.ids, m.first) for m in got if m.ids]


def _tick(r: Router, now: float) -> None:
    """The router's timed work at ``now``, every worker having just been heard from."""
    for w in r.workers.values():
        w.last_seen = now
    r.tick(now)


def _moved(r: Router, decode: str, prefill: str) -> Req:
    (req,) = r.hub.take(decode.encode(), Req)
    assert r.hub.take(prefill.encode(), Req) == [req]
    return req


def test_a_dead_decodes_request_goes_on_elsewhere_with_the_tokens_so_far(router):
    first = _submit(router, temperature=0.7, seed=9)
    router.dispatch(b"p0", Tokens(first.rid, [7], first=True))
    router.dispatch(b"d0", Tokens(first.rid, [7], first=True))
    router.dispatch(b"d0", Tokens(first.rid, [8]))
    router.dispatch(b"p0", Prefilled(first.rid, "sent"))
    assert _stream(router) == [([7], True), ([8], False)]
    _die(router, "d0")
    assert router.hub.take(CLIENT) == []                   # no error: the stream waits
    assert router.hub.take(b"p0", Abort) == []             # p0 owes nothing any more
    req = _moved(router, "d1", "p0")             # both idle now: ties go to the name
    assert req.rid == f"{first.rid}~1" and req.label == "a"
    assert unpack_ids(req.prompt).tolist() == PROMPT + [7, 8] and req.prior == 2
    assert req.params == {**first.params, "max_new_tokens": 4} and req.cap != first.cap
    # the new attempt: its prefill's first token is the request's third, no "first" flag
    router.dispatch(b"p0", Tokens(req.rid, [5], first=True))
    router.dispatch(b"d1", Tokens(req.rid, [5], first=True))     # the repeat: dropped
    router.dispatch(b"d1", Tokens(req.rid, [16, 14, 13]))
    router.dispatch(b"d0", Tokens(first.rid, [99]))              # the dead one's last words
    router.dispatch(b"p0", Prefilled(req.rid, "sent"))
    router.dispatch(b"d1", Done(req.rid, "length", n=4))
    assert _stream(router, keep_done=True) == [([5], False), ([16, 14, 13], False)]
    (done,) = router.hub.take(CLIENT, Done)
    assert (done.reason, done.n, done.migrations, done.error) == ("length", 6, 1, "")
    assert "stray_report" not in router.errors                  # expected, not strays
    assert not router.routes and all(w.assigned == 0 for w in router.workers.values())
    text = render_snapshot(router.metrics.snapshot())[0].decode()
    assert by(parse(text), "pdkv_migrations_total", ("cause",)) == {("decode_lost",): 1.0}


def test_a_prefill_dead_before_the_kv_landed_is_replaced_and_the_decode_frees_migrated(router):
    first = _submit(router)
    router.dispatch(b"p0", Tokens(first.rid, [7], first=True))   # computed, not landed
    _die(router, "p0")
    assert router.hub.take(b"d0", Abort) == [Abort(first.rid, "migrated")]
    req = _moved(router, "d1", "p1")        # d0 still counts the row it is freeing
    assert unpack_ids(req.prompt).tolist() == PROMPT + [7] and req.prior == 1


def test_a_prefill_dead_after_the_decode_holds_the_kv_costs_nothing(router):
    first = _submit(router)
    router.dispatch(b"d0", Tokens(first.rid, [7], first=True))   # the decode holds the KV
    _die(router, "p0")
    assert router.hub.take(b"d0") == [] and router.hub.take(b"d1") == []
    router.dispatch(b"d0", Tokens(first.rid, [18, 19, 11, 12, 13]))
    router.dispatch(b"d0", Done(first.rid, "length", n=6))
    (done,) = router.hub.take(CLIENT, Done)                 # at once: no grace to wait
    assert (done.reason, done.n, done.migrations) == ("length", 6, 0)


def test_a_decode_whose_transfer_lost_its_prefill_gets_it_again_from_another(router):
    first = _submit(router)
    router.dispatch(b"d0", Done(first.rid, "peer_lost", error="prefill p0 lost: silent"))
    assert router.hub.take(CLIENT, Done) == []
    assert router.hub.take(b"p0", Abort) == [Abort(first.rid, "migrated")]
    req = _moved(router, "d1", "p1")        # p0 still counted the prompt it was told to drop
    assert req.rid == f"{first.rid}~1" and req.prior == 0


def test_a_request_whose_output_was_complete_just_ends(router):
    first = _submit(router, stop_token=8)
    router.dispatch(b"d0", Tokens(first.rid, [7], first=True))
    router.dispatch(b"d0", Tokens(first.rid, [8]))          # the stop token
    _die(router, "d0")
    (done,) = router.hub.take(CLIENT, Done)
    assert (done.reason, done.n, done.migrations) == ("stop", 2, 0)
    assert not router.hub.take(b"d1", Req)


def test_moves_are_bounded_and_the_last_failure_says_why(router):
    router.config = CFG.with_overrides(max_migrations=1)
    first = _submit(router)
    _die(router, "d0")
    req = _moved(router, "d1", "p1")
    for name in ("p0", "p1"):                     # new workers: somewhere to move to
        router.dispatch(f"{name}x".encode(), Register("decode", f"{name}x", 7))
        router.dispatch(f"{name}x".encode(), Ready(f"{name}x", "", 400))
    _die(router, "d1")
    (done,) = router.hub.take(CLIENT, Done)
    assert done.reason == "error" and "moved 1 times already (max_migrations)" in done.error
    assert first.rid != req.rid and not router.routes
    # past the limit a decode's own failure ends the request with its own words
    router.config = CFG.with_overrides(max_migrations=0)
    first = _submit_to(router, "p0x")
    router.dispatch(b"p0x", Done(first.rid, "timeout", error="no KV within 3 s"))
    router.dispatch(first.prefill.encode(), Prefilled(first.rid, "aborted"))
    (done,) = router.hub.take(CLIENT, Done)
    assert (done.reason, done.error) == ("timeout", "no KV within 3 s")


def test_no_worker_to_take_it_fails_it_with_the_reason(router):
    _submit(router)
    _die(router, "d1")
    _die(router, "d0")
    (done,) = router.hub.take(CLIENT, Done)
    assert done.reason == "error" and "worker d0 lost" in done.error
    assert "no other worker could take it over" in done.error


def test_a_client_abort_after_a_move_reaches_the_new_attempts_workers(router):
    _submit(router)
    _die(router, "d0")
    req = _moved(router, "d1", "p1")
    assert router.hub.take(b"p0", Abort) == [Abort(req.rid.split("~")[0], "migrated")]
    router.dispatch(CLIENT, Abort("a"))
    assert router.hub.take(b"d1", Abort) == [Abort(req.rid)]
    assert router.hub.take(b"p1", Abort) == [Abort(req.rid)]
    router.dispatch(b"d1", Done(req.rid, "aborted"))
    router.dispatch(b"p1", Prefilled(req.rid, "aborted"))
    (done,) = router.hub.take(CLIENT, Done)
    assert done.reason == "aborted" and done.migrations == 1


def test_a_draining_worker_gets_nothing_new_finishes_then_hands_over_then_shuts_down(router):
    router.config = CFG.with_overrides(drain_timeout_s=5.0)
    first = _submit(router)
    router.dispatch(b"d0", Tokens(first.rid, [7], first=True))
    router.dispatch(CLIENT, Drain("d0", nonce=4))            # no keys: anyone may ask
    (report,) = router.hub.take(CLIENT, StatusReport)
    assert report.nonce == 4 and report.workers["d0"]["draining"]
    router.dispatch(CLIENT, Submit("b", pack_ids(PROMPT), {"max_new_tokens": 2}))
    assert router.hub.take(b"d1", Req)[0].label == "b"       # nothing new for d0
    assert router.hub.take(b"p1", Req)[0].label == "b"
    t0 = router.workers["d0"].draining
    _tick(router, t0 + 1.0)
    assert router.hub.take(b"d0", Shutdown) == [] and router.hub.take(b"d0", Abort) == []
    _tick(router, t0 + 5.5)                                   # past drain_timeout_s
    assert router.hub.take(b"d0", Abort) == [Abort(first.rid, "migrated")]
    assert router.hub.take(b"p0", Abort) == [Abort(first.rid, "migrated")]
    req = _moved(router, "d1", "p0")          # p0's share of the last attempt given back
    assert req.prior == 1 and unpack_ids(req.prompt).tolist() == PROMPT + [7]
    _tick(router, t0 + 5.6)                                   # it holds nothing now
    assert router.hub.take(b"d0", Shutdown) == [Shutdown()]
    assert router.workers["d0"].lost                          # its name is free again
    router.dispatch(b"d0-new", Register("decode", "d0", 101))
    assert isinstance(router.hub.take(b"d0-new")[0], Registered)


def test_a_worker_drains_itself_and_an_idle_one_shuts_down_at_once(router):
    router.dispatch(b"p1", Drain("p1"))                       # its SIGTERM
    assert router.hub.take(b"p1", StatusReport) == []         # a worker gets no report
    _tick(router, router.workers["p1"].draining)
    assert router.hub.take(b"p1", Shutdown) == [Shutdown()]
    router.dispatch(CLIENT, Drain("nobody"))
    (err,) = router.hub.take(CLIENT, Error)
    assert err.code == "unknown_worker" and "no live worker 'nobody'" in err.error


def test_a_request_its_worker_gave_up_on_its_own_moves_and_a_clients_abort_does_not(router):
    # a tensor-parallel decode that lost a rank ends all it held as "aborted"
    first = _submit(router)
    router.dispatch(b"d0", Done(first.rid, "aborted", error="d0: a tensor-parallel rank "
                                "was lost"))
    assert router.hub.take(CLIENT, Done) == []
    assert _moved(router, "d1", "p1").rid == f"{first.rid}~1"
    router.dispatch(CLIENT, Abort("a"))                      # now the client asks
    router.dispatch(b"d1", Done(f"{first.rid}~1", "aborted"))
    router.dispatch(b"p1", Prefilled(f"{first.rid}~1", "aborted"))
    (done,) = router.hub.take(CLIENT, Done)
    assert done.reason == "aborted" and not router.hub.take(b"d0", Req)
