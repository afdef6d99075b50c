"""The router in process over a fake hub: registration, routing, relaying, aborts, lost
workers and shutdown, message by message (no sockets, no workers)."""

from __future__ import annotations

import dataclasses

import pytest

from common.config import ServeConfig
from common.control import (
    Abort,
    Bye,
    Done,
    Error,
    Ping,
    Prefilled,
    Ready,
    Register,
    Registered,
    Req,
    Shutdown,
    Stats,
    Submit,
    Tokens,
    pack_ids,
)
from common.request import BadRequest
from deploy.router.placement import WorkerInfo, admits_at_once, pick
from deploy.router.router import Router
from tests.fakes import FakeHub, settle

CFG = ServeConfig(page_size=4, decode_pages=101, prefill_pages=51, heartbeat_s=0.5,
                  lease_s=3.0)
CLIENT = b"client"


@pytest.fixture
def router():
    r = Router(FakeHub(), CFG)
    yield r
    r.hub.close()
    r.ctx.term()


def _join(r: Router, name: str, role: str, pool_tokens: int, kv_addr: str = "") -> bytes:
    peer = name.encode()
    r.dispatch(peer, Register(role, name, 100))
    assert isinstance(r.hub.take(peer)[0], Registered)
    r.dispatch(peer, Ready(name, kv_addr, pool_tokens))
    return peer


def _relayed(r: Router) -> list:
    """What the client got, without the output's text (``test_router_text`` checks it)."""
    return [dataclasses.replace(m, text="") if isinstance(m, (Tokens, Done)) else m
            for m in r.hub.take(CLIENT)]


def _submit(r: Router, label: str, tokens: list[int], **params) -> str:
    """Submit as the client; returns the router's id of the request (from its Req)."""
    r.dispatch(CLIENT, Submit(label, pack_ids(tokens), params))
    (req,) = r.hub.take(b"d0", Req)
    r.hub.take(b"p0", Req)
    assert req.label == label and req.rid.startswith(f"{label}#")
    # admitted: the client hears it first, with the prompt's length
    assert r.hub.take(CLIENT, Tokens) == [Tokens(label, [], prompt_tokens=len(tokens))]
    return req.rid


def _deployment(r: Router) -> None:
    _join(r, "p0", "prefill", 200, "ipc:///p0")
    _join(r, "d0", "decode", 400)
    _join(r, "d1", "decode", 400)


def test_a_request_goes_to_the_least_loaded_decode_and_a_prefill(router):
    _deployment(router)
    router.dispatch(CLIENT, Submit("a", pack_ids([1] * 100), {"max_new_tokens": 50}))
    to_d0, to_p0 = router.hub.take(b"d0", Req), router.hub.take(b"p0", Req)
    assert len(to_d0) == 1 and to_d0 == to_p0       # the same Req to both
    req = to_d0[0]
    assert (req.prefill, req.prefill_addr, req.decode) == ("p0", "ipc:///p0", "d0")
    assert req.eager                                 # d0 surely has room: no waiting
    router.dispatch(CLIENT, Submit("b", pack_ids([1] * 10), {"max_new_tokens": 5}))
    assert router.hub.take(b"d1", Req)[0].label == "b"   # d0 holds 150 of 400 tokens now
    assert router.workers["d0"].assigned == 150 and router.workers["p0"].assigned == 110


def test_tokens_are_relayed_and_done_carries_the_prefills_figures(router):
    _deployment(router)
    rid = _submit(router, "a", [3] * 8, max_new_tokens=3)
    router.dispatch(b"d0", Tokens(rid, [7], first=True, t_kv_wall=1000.25))
    router.dispatch(b"d0", Tokens(rid, [8, 9]))
    assert _relayed(router) == [Tokens("a", [7], first=True), Tokens("a", [8, 9])]
    router.dispatch(b"d0", Done(rid, "length", n=3))
    assert router.hub.take(CLIENT) == []             # waits for the prefill's report
    router.dispatch(b"p0", Prefilled(rid, "sent", xfer_s=0.5, kv_bytes=4096,
                                     t_finish_wall=1000.0))
    (done,) = _relayed(router)
    assert done == Done("a", "length", n=3, xfer_s=0.25, kv_bytes=4096, prompt_tokens=8)
    assert not router.routes and router.workers["d0"].assigned == 0


def test_the_prefills_first_token_goes_out_at_once_and_the_decodes_repeat_is_dropped(router):
    _deployment(router)
    rid = _submit(router, "a", [3] * 8, max_new_tokens=3)
    router.dispatch(b"p0", Tokens(rid, [7], first=True))   # computed: before any KV moved
    assert _relayed(router) == [Tokens("a", [7], first=True)]
    router.dispatch(b"d0", Tokens(rid, [7], first=True, t_kv_wall=1000.25))  # KV is in
    router.dispatch(b"d0", Tokens(rid, [8, 9]))
    assert _relayed(router) == [Tokens("a", [8, 9])]   # 7 once, in order
    router.dispatch(b"d0", Done(rid, "length", n=3))
    router.dispatch(b"p0", Prefilled(rid, "sent", kv_bytes=4096, t_finish_wall=1000.0))
    (done,) = router.hub.take(CLIENT)
    assert done.n == 3 and done.xfer_s == 0.25      # the decode's KV time still counts
    assert not router.errors


def test_a_first_token_the_decode_relayed_first_is_not_relayed_again(router):
    _deployment(router)
    rid = _submit(router, "a", [3] * 8, max_new_tokens=3)
    router.dispatch(b"d0", Tokens(rid, [7], first=True))
    router.dispatch(b"p0", Tokens(rid, [7], first=True))   # the prefill's came later
    router.dispatch(b"d0", Tokens(rid, [8]))
    assert _relayed(router) == [Tokens("a", [7], first=True), Tokens("a", [8])]


def test_a_prefill_may_send_only_the_first_token_of_its_own_requests(router):
    _deployment(router)
    _join(router, "p1", "prefill", 200, "ipc:///p1")
    rid = _submit(router, "a", [3] * 8, max_new_tokens=3)
    router.dispatch(b"p0", Tokens(rid, [7, 8], first=True))   # more than the first
    router.dispatch(b"p0", Tokens(rid, [8]))                    # not the first
    router.dispatch(b"p1", Tokens(rid, [7], first=True))        # not its request
    assert router.hub.take(CLIENT) == []
    assert router.errors["forbidden.Tokens"] == 3
    router.dispatch(b"d0", Tokens(rid, [7], first=True))
    assert _relayed(router) == [Tokens("a", [7], first=True)]


def test_first_tokens_that_disagree_are_counted(router):
    _deployment(router)
    rid = _submit(router, "a", [3] * 8, max_new_tokens=3)
    router.dispatch(b"p0", Tokens(rid, [7], first=True))
    router.dispatch(b"d0", Tokens(rid, [6, 9], first=True))
    assert _relayed(router) == [Tokens("a", [7], first=True), Tokens("a", [9])]
    assert router.errors["first_token_mismatch"] == 1


def test_done_goes_out_after_a_grace_period_without_the_prefills_report(router):
    _deployment(router)
    rid = _submit(router, "a", [3] * 8, max_new_tokens=3)
    router.dispatch(b"d0", Done(rid, "length", n=3))
    route = router.routes.get(rid)
    router.tick(route.t_grace + 0.01)
    assert router.hub.take(CLIENT, Done) == [Done("a", "length", n=3, prompt_tokens=8)]


def test_a_client_abort_reaches_both_workers_and_an_unknown_one_is_an_error(router):
    _deployment(router)
    rid = _submit(router, "a", [3] * 8)
    router.dispatch(CLIENT, Abort("a"))
    assert router.hub.take(b"d0", Abort) == [Abort(rid)] == router.hub.take(b"p0", Abort)
    router.dispatch(b"d0", Done(rid, "error", error="transfer ended"))  # a race: "error"
    router.dispatch(b"p0", Prefilled(rid, "aborted"))
    (done,) = router.hub.take(CLIENT, Done)
    assert done.reason == "aborted"                   # the client asked for it
    router.dispatch(CLIENT, Abort("zzz"))
    (err,) = router.hub.take(CLIENT, Error)
    assert err.code == "unknown_rid" and "'zzz'" in err.error


def test_a_decode_failure_aborts_the_prefill_and_names_the_cause(router):
    router.config = CFG.with_overrides(max_migrations=0)   # else the request moves
    _deployment(router)
    rid = _submit(router, "a", [3] * 8)
    router.dispatch(b"d0", Done(rid, "error", error="transfer timed out"))
    assert router.hub.take(b"p0", Abort) == [Abort(rid)]
    router.dispatch(b"p0", Prefilled(rid, "error", error="prefill p0 failed: boom"))
    (done,) = router.hub.take(CLIENT, Done)
    assert done.error == "prefill p0 failed: boom (decode: transfer timed out)"


def test_a_worker_that_cannot_take_a_request_ends_it_with_its_words(router):
    """A worker answers a Req it cannot decode with an Error: it will never report on
    that request, so the client hears it at once and the other worker is told to abort."""
    _deployment(router)
    rid = _submit(router, "a", [3] * 8)
    router.dispatch(b"d0", Error(rid, "d0: Req.params must be dict", "bad_field"))
    (done,) = router.hub.take(CLIENT, Done)
    assert done.rid == "a" and done.reason == "error"
    assert "worker d0 could not serve the request (bad_field)" in done.error
    assert router.hub.take(b"p0", Abort) == [Abort(rid)]
    rid = _submit(router, "b", [3] * 8)   # a late error from a worker done with it: kept
    router.dispatch(b"p0", Prefilled(rid, "sent"))
    router.dispatch(b"p0", Error(rid, "p0: unknown request", "unknown_rid"))
    assert router.hub.take(CLIENT, Done) == []
    router.dispatch(b"d0", Done(rid, "length", n=3))
    assert router.hub.take(CLIENT, Done)[0].reason == "length"


def test_a_silent_worker_is_lost_and_its_requests_move(router):
    _deployment(router)
    rid = _submit(router, "a", [3] * 8)
    now = router.workers["d0"].last_seen
    for name in ("p0", "d1"):
        router.workers[name].last_seen = now + CFG.lease_s
    router.tick(now + CFG.lease_s + 0.5)
    assert router.workers["d0"].lost and not router.workers["p0"].lost
    assert router.hub.take(CLIENT, Done) == []               # the client waits on
    assert router.hub.take(b"p0", Abort) == [Abort(rid, "migrated")]
    (moved,) = router.hub.take(b"d1", Req)                  # d1 takes it over
    assert moved.rid == f"{rid}~1" and moved.label == "a"
    router.dispatch(CLIENT, Submit("b", pack_ids([3] * 8), {}))
    assert router.hub.take(b"d1", Req)[0].label == "b"  # routing goes on without d0


def test_registration_refuses_a_live_name_and_an_unknown_role(router):
    _join(router, "d0", "decode", 400)
    router.dispatch(b"other", Register("decode", "d0", 7))
    router.dispatch(b"x", Register("trainer", "t0", 8))
    codes = {peer: router.hub.take(peer)[0].code for peer in (b"other", b"x")}
    assert codes == {b"other": "name_taken", b"x": "refused"}
    router.hub.gone.add(b"d0")                                   # d0 died
    router.dispatch(b"other", Register("decode", "d0", 7))       # a restart takes its name
    assert isinstance(router.hub.take(b"other")[0], Registered)
    assert router.workers["d0"].peer == b"other" and router.workers["d0"].pid == 7


def test_shutdown_answers_bye_with_every_workers_stats(router):
    _deployment(router)
    router.dispatch(b"d9", Register("decode", "d9", 100))   # registered, never ready:
    router.dispatch(CLIENT, Shutdown())                     # nothing to wait for
    for name in ("p0", "d0", "d1"):
        assert router.hub.take(name.encode(), Shutdown) == [Shutdown()]
        assert not router.shutdown_complete()
        router.dispatch(name.encode(), Stats(name, {"tokens": 5}))
    assert router.shutdown_complete()
    (bye,) = router.hub.take(CLIENT, Bye)
    assert bye.stats["d1"] == {"role": "decode", "tokens": 5}
    assert bye.stats["d9"] == {"role": "decode"}


def test_pings_go_to_live_workers_every_heartbeat(router):
    _deployment(router)
    router.tick(0.0)
    assert all(router.hub.take(p, Ping) == [Ping()] for p in (b"p0", b"d0", b"d1"))
    router.tick(CFG.heartbeat_s / 2)
    assert not any(router.hub.take(p, Ping) for p in (b"p0", b"d0", b"d1"))


def test_router_picks_the_least_loaded_workers_that_can_hold_the_request():
    d0 = WorkerInfo("d0", "decode", b"d0", pool_tokens=1000, ready=True, assigned=500)
    d1 = WorkerInfo("d1", "decode", b"d1", pool_tokens=4000, ready=True, assigned=1000)
    small = WorkerInfo("d2", "decode", b"d2", pool_tokens=100, ready=True)
    p0 = WorkerInfo("p0", "prefill", b"p0", pool_tokens=1000, ready=True, assigned=300)
    p1 = WorkerInfo("p1", "prefill", b"p1", pool_tokens=1000, ready=True, assigned=100)
    lost = WorkerInfo("p2", "prefill", b"p2", pool_tokens=1000, ready=True, lost=True)
    decode, prefill = pick([d0, d1, small, p0, p1, lost], 50, 200)
    assert (decode.name, prefill.name) == ("d1", "p1")   # d2 cannot hold 200 tokens
    with pytest.raises(BadRequest, match="no ready worker can hold 5000 tokens"):
        pick([d0, d1, p0], 50, 5000)
    cfg = ServeConfig(page_size=16)
    assert admits_at_once(d0, 400, cfg) and not admits_at_once(d0, 490, cfg)


def test_every_submission_gets_its_own_id_and_a_label_is_free_again_once_done(router):
    _deployment(router)
    first = _submit(router, "s4-r00000", [1] * 8, max_new_tokens=2)
    router.dispatch(CLIENT, Submit("s4-r00000", pack_ids([1] * 8), {}))   # in flight
    (err,) = router.hub.take(CLIENT, Error)
    assert err.code == "bad_request" and "already in flight" in err.error
    router.dispatch(b"other-client", Submit("s4-r00000", pack_ids([1] * 8), {}))
    other = router.hub.take(b"d1", Req)[0].rid        # another client's label: fine
    router.dispatch(b"d0", Done(first, "length", n=2))
    router.dispatch(b"p0", Prefilled(first, "sent"))
    assert router.hub.take(CLIENT, Done)[0].rid == "s4-r00000"
    again = _submit(router, "s4-r00000", [1] * 8, max_new_tokens=2)   # a rerun
    assert len({first, other, again}) == 3
    router.dispatch(b"d0", Done(first, "length", n=2))   # late report of the old one
    assert router.hub.take(CLIENT) == [] and router.errors["stray_report"] == 1


def test_reports_from_a_worker_that_does_not_serve_the_request_are_refused(router):
    _deployment(router)
    rid = _submit(router, "a", [1] * 8)
    router.dispatch(b"d1", Tokens(rid, [5]))
    router.dispatch(b"d1", Done(rid, "length", n=1))
    assert router.hub.take(CLIENT) == []
    assert [e.code for e in router.hub.take(b"d1", Error)] == ["forbidden"] * 2
    assert router.errors["forbidden.Tokens"] == router.errors["forbidden.Done"] == 1


def test_a_lost_prefill_fails_only_the_requests_it_still_owes(router):
    # once a prefill reported its part (the decode acknowledged every page) its loss
    # must not end a request that is decoding on a healthy decode
    _join(router, "p0", "prefill", 200, "ipc:///p0")
    _join(router, "d0", "decode", 400)
    decoding = _submit(router, "a", [3] * 8)
    router.dispatch(b"p0", Prefilled(decoding, "sent", kv_bytes=4096))
    prefilling = _submit(router, "b", [3] * 8)
    router.hub.gone.add(b"p0")
    router._send_worker("p0", Abort("x"))             # the router finds p0 gone
    assert router.workers["p0"].lost
    (done,) = router.hub.take(CLIENT, Done)
    assert done.rid == "b" and "worker p0 lost" in done.error
    router.dispatch(b"d0", Tokens(decoding, [7, 8], first=True))
    router.dispatch(b"d0", Done(decoding, "length", n=2))
    assert router.hub.take(CLIENT, Done)[0].reason == "length"
    assert prefilling not in {r.rid for r in router.routes} and len(router.routes) == 0


def test_both_workers_of_a_request_dying_ends_it_once(router):
    _deployment(router)
    rid = _submit(router, "a", [1] * 8)
    router.hub.gone |= {b"d0", b"p0"}                 # both processes died
    router._send_worker("d0", Abort(rid))             # the router finds d0 gone ...
    assert router.workers["d0"].lost and router.workers["p0"].lost   # ... and then p0
    (done,) = router.hub.take(CLIENT, Done)        # it moved to d1, then found no prefill
    assert done.reason == "error" and "worker p0 lost" in done.error
    assert "no other worker could take it over" in done.error
    assert len(router.routes) == 0
    router.dispatch(CLIENT, Submit("b", pack_ids([1] * 8), {}))
    (err,) = router.hub.take(CLIENT, Error)
    assert "no ready prefill" in err.error             # it serves on and says why


@pytest.mark.parametrize("label", ["", "x" * 257, "two\nlines", "bell\a"])
def test_a_rid_that_cannot_name_a_request_everywhere_is_refused(router, label):
    _deployment(router)
    router.dispatch(CLIENT, Submit(label, pack_ids([1] * 4), {}))
    (err,) = router.hub.take(CLIENT, Error)
    assert "rid must be 1..256 printable characters" in err.error, err.error
    assert not router.hub.take(b"d0", Req) and len(router.routes) == 0
    _submit(router, "x" * 256, [1] * 4)                # the longest that is served


@pytest.mark.parametrize("text, messages", [
    ("hello " * 12000, []), ("", [{"role": "user", "content": "hello " * 12000}])])
def test_a_text_too_long_for_the_context_is_refused_before_encoding(router, text, messages):
    _deployment(router)
    router.dispatch(CLIENT, Submit("t", b"", {}, text=text, messages=messages))
    settle(router)   # the first text builds the tokenizer on an encoding thread
    router.dispatch(CLIENT, Submit("u", b"", {}, text=text, messages=messages))  # in the loop
    errors = router.hub.take(CLIENT, Error)
    assert [e.rid for e in errors] == ["t", "u"]
    for err in errors:
        assert "text of 72000 characters exceeds the model's context of 4096" in err.error
    assert not router.hub.take(b"d0", Req)


@pytest.mark.parametrize("tokens, params, words", [
    ([1] * 5000, {}, "exceeds the model's context of 4096 positions"),
    ([1] * 4000, {"max_new_tokens": 200}, "exceeds the model's context"),
    ([1] * 4, {"temperature": 1e9}, "temperature"),
    ([1] * 4, {"seed": -1}, "seed"),
    ([1] * 4, {"stop_token": True}, "stop_token"),
])
def test_the_door_refuses_what_the_model_or_sampling_cannot_serve(router, tokens, params,
                                                                   words):
    _join(router, "p0", "prefill", 1 << 20, "ipc:///p0")
    _join(router, "d0", "decode", 1 << 20)
    router.dispatch(CLIENT, Submit("x", pack_ids(tokens), params))
    (err,) = router.hub.take(CLIENT, Error)
    assert words in err.error, err.error
    assert not router.hub.take(b"d0", Req)


def test_a_vanishing_temperature_is_served_as_greedy(router):
    _deployment(router)
    router.dispatch(CLIENT, Submit("t", pack_ids([1] * 4), {"temperature": 1e-310}))
    (req,) = router.hub.take(b"d0", Req)
    assert req.params["temperature"] == 0.0


def test_a_lost_worker_heard_again_is_told_so_and_rejoins_on_registering(router):
    _deployment(router)
    rid = _submit(router, "a", [1] * 8)
    router._lose(router.workers["d0"], "silent for 9.0s")    # e.g. SIGSTOPped
    router.hub.take(CLIENT)
    router.dispatch(b"d0", Tokens(rid, [5]))                 # SIGCONT: it speaks again
    (err,) = router.hub.take(b"d0", Error)
    assert err.code == "lost" and router.hub.take(CLIENT) == []
    router.dispatch(b"d0", Register("decode", "d0", 100))
    assert isinstance(router.hub.take(b"d0")[0], Registered)
    router.dispatch(b"d0", Register("decode", "d0", 100))    # a repeat before Ready
    assert isinstance(router.hub.take(b"d0")[0], Registered)
    assert not router.workers["d0"].lost and not router.workers["d0"].ready
    router.dispatch(b"d0", Ready("d0", "", 400))
    router.workers["d1"].assigned = 300                      # d0 is the least loaded again
    assert _submit(router, "b", [1] * 8).startswith("b#")


def test_a_worker_building_its_model_has_the_startup_deadline_not_the_lease(router):
    router.dispatch(b"d0", Register("decode", "d0", 100))
    t = router.workers["d0"].last_seen
    router.tick(t + CFG.lease_s * 3)                        # silent, but still building
    assert not router.workers["d0"].lost
    router.tick(t + CFG.ready_timeout_s + 1)
    assert router.workers["d0"].lost
