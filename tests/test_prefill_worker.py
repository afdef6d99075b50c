"""The prefill worker in process: built over a fake router link (no network), its
requests streamed to a real ``KvReceiver`` in this process, or aborted, or failed, each
ending once with its reason; the free log replays clean."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from common.config import ServeConfig
from common.control import (
    Abort,
    Error,
    Load,
    MetricsReport,
    Ping,
    Prefilled,
    Ready,
    Registered,
    Req,
    Shutdown,
    Stats,
    pack_ids,
)
from common.freelog import FreeLogReader, replay_file
from common.kv import KvCache
from common.model import ModelRunner, generate_greedy
from common.node import PrefixReuse, RouterLost
from common.request import ReqState
from prefill_node.busy import BusyTime
from prefill_node.worker import PrefillWorker
from tests.fakes import FakeLink
from tests.model_helpers import DraftWatchingRunner, prompt
from transport import EventKind, KvReceiver, TransportConfig

CFG = ServeConfig(dtype="float64", page_size=4, prefill_pages=64, chunk_size=8,
                  max_prefill_tokens=16, spec_k=0, heartbeat_s=0.2, lease_s=3.0)


@pytest.fixture
def prefill(tmp_path):
    link = FakeLink()
    worker = PrefillWorker("p0", link, kv_bind=f"ipc://{tmp_path}/p0.sock",
                           log_dir=str(tmp_path))
    assert worker.config is None and link.sent == []   # building did no I/O
    worker.start(CFG)
    (ready,) = link.take(Ready)
    assert ready.kv_addr == f"ipc://{tmp_path}/p0.sock" and ready.pool_tokens == 63 * 4
    yield worker, link
    if worker.built:
        worker.close()


def _req(rid: str, tokens: list[int], eager: bool = True, **params) -> Req:
    return Req(rid, pack_ids(tokens), {"max_new_tokens": 4, **params}, prefill="p0",
               prefill_addr="", decode="d0", eager=eager)


def _connect(rx: KvReceiver, worker: PrefillWorker) -> int:
    """The receiver's handshake blocks until the prefill answers, which it does in its
    loop: connect on a thread while this one runs the worker."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(rx.connect(worker.kv_address())))
    thread.start()
    while thread.is_alive():
        worker.tick()
        thread.join(0.01)
    assert out, "handshake failed"
    return out[0]


def _frees(tmp_path) -> list[tuple[str, str]]:
    report = replay_file(tmp_path / "p0.freelog")
    assert report.ok, report.format()
    return [(e["owner"], e["reason"]) for e in FreeLogReader(tmp_path / "p0.freelog").records
            if e.get("op") == "free"]


def test_a_request_streams_to_a_real_receiver_and_is_freed_as_sent(prefill, tmp_path,
                                                                   model):
    worker, link = prefill
    tokens = prompt(30, seed=1)
    decode = KvCache(64, 4, layout=CFG.model_config().kv_layout(False), node="d")
    rx = KvReceiver(decode, TransportConfig(node="d0", model="tiny", heartbeat_s=0.2,
                                            model_digest=worker.runner.fingerprint,
                                            lease_s=3.0, shared_memory=False))
    try:
        kv = decode.open_row("a")
        decode.extend(kv, 30)
        rx.announce("a", kv, 30, 0, _connect(rx, worker))
        worker.dispatch(_req("a", tokens, eager=False))
        first, deadline = None, time.monotonic() + 60
        while first is None and time.monotonic() < deadline:
            worker.tick()
            for ev in rx.poll(0.01):
                assert ev.kind in (EventKind.COMPLETED,), ev
                first = ev.first_token
        assert first == generate_greedy(model, [tokens], 1)[0][0]
        while "a" in worker.reqs and time.monotonic() < deadline:   # the acknowledgement
            worker.tick()
            rx.poll(0.01)
        (done,) = link.take(Prefilled)
        assert done.reason == "sent"
        assert done.kv_bytes == 8 * worker.cache.layout.page_bytes(4)   # 8 pages carried
        assert worker.counts["sent"] == 1 and worker.busy.num_spans <= 1
    finally:
        rx.close()
        decode.free_kv_row(kv, [(0, 30)], reason="finished")
        decode.close_row(kv)
        decode.close()
    worker.close()
    assert _frees(tmp_path) == [("a", "sent")]


def test_an_abort_at_any_stage_frees_the_row_and_reports_aborted(prefill, tmp_path):
    worker, link = prefill
    worker.dispatch(_req("queued", prompt(9, seed=2), eager=False))     # no announce yet
    worker.dispatch(_req("running", prompt(40, seed=3)))
    worker.tick()
    assert worker.reqs["running"].state == ReqState.PREFILLING
    assert worker.reqs["queued"].state == ReqState.QUEUED
    for rid in ("queued", "running"):
        req = worker.reqs[rid]
        worker.dispatch(Abort(rid))
        assert req.state == ReqState.ABORTED and req.kv is None
    assert [(m.rid, m.reason) for m in link.take(Prefilled)] == [("queued", "aborted"),
                                                                 ("running", "aborted")]
    worker.close()
    assert _frees(tmp_path) == [("running", "aborted")]


class _BrokenReuse(PrefixReuse):
    """A prefix reuse whose load fails unexpectedly (a bug, a broken host tier)."""

    def load_request(self, req, *, commit=True):
        raise OSError("host tier unreadable")


def test_a_failure_while_admitting_fails_that_request_alone(prefill, tmp_path):
    worker, link = prefill
    good = worker.prefix_reuse
    worker.prefix_reuse = _BrokenReuse(worker.offloader, b"", 1.0)
    worker.dispatch(_req("bad", prompt(12, seed=4)))
    worker.tick()
    (failed,) = link.take(Prefilled)
    assert failed.reason == "error" and "host tier unreadable" in failed.error
    assert worker.counts == {"sent": 0, "aborted": 0, "failed": 1, "migrated": 0,
                             "prompt_tokens": 0}
    worker.prefix_reuse = good
    worker.dispatch(_req("next", prompt(12, seed=5)))
    worker.tick()
    assert worker.reqs["next"].state == ReqState.PREFILLING      # it serves on
    worker.close()
    assert _frees(tmp_path) == [("bad", "error"), ("next", "aborted")]


def test_control_messages_are_dispatched_by_type(prefill):
    worker, link = prefill
    worker.dispatch(Ping())
    worker.dispatch(Stats("x", {}))                  # a worker does not take Stats
    (err,) = link.take(Error)
    assert err.code == "unexpected" and "does not take Stats" in err.error
    worker._heartbeat()
    (load,) = link.take(Load)
    assert load.name == "p0" and load.free_tokens == 63 * 4
    (report,) = link.take(MetricsReport)                     # metrics ride the heartbeat
    assert not report.final and report.families
    worker.dispatch(Shutdown())
    assert worker.stopping
    worker.close()
    assert [type(m).__name__ for m in link.sent] == ["MetricsReport", "Stats"]
    assert link.sent[0].final and link.closed


def test_busy_time_is_the_union_of_windows_in_bounded_memory():
    busy = BusyTime()
    for window in [(0, 2), (1, 3), (5, 6)]:
        busy.add(*window)
    assert busy.seconds == 4
    busy.add(2.5, 5.5)                      # bridges the gap: [0, 6)
    assert busy.seconds == 6 and busy.num_spans == 1
    gappy = BusyTime()
    gappy.add(0, 1, horizon=0)
    gappy.add(5, 6, horizon=2)              # [0, 1) can no longer be overlapped: folded
    gappy.add(2, 7, horizon=2)              # overlaps [5, 6) only
    assert gappy.seconds == 6 and gappy.num_spans == 1
    for t in range(1000):                   # a long run keeps one span, not a thousand
        gappy.add(10 + t, 10.5 + t, horizon=10 + t)
    assert gappy.num_spans <= 1 and gappy.seconds == 6 + 500


def test_a_worker_that_lost_its_router_ends_its_requests_keeps_its_pool_and_rejoins(
        prefill, tmp_path):
    worker, link = prefill
    worker.dispatch(_req("a", prompt(40, seed=7)))
    worker.tick()
    cache = worker.cache
    worker._last_router -= CFG.lease_s + 1                   # the router went silent
    with pytest.raises(RouterLost, match="router silent"):
        worker.poll_control()
    link.inbox.append(Registered(CFG.to_dict()))             # a router at the address
    worker._rejoin(RouterLost("router silent"))
    (ended,) = link.take(Prefilled)
    assert ended.reason == "aborted" and "lost its router" in ended.error
    assert [type(m).__name__ for m in link.sent] == ["Register", "Ready"]
    assert worker.cache is cache and not worker.reqs          # same pool, nothing held
    worker.dispatch(_req("b", prompt(9, seed=8)))             # and it serves
    worker.tick()
    assert worker.reqs["b"].state == ReqState.PREFILLING
    link.inbox.append(Error("", "worker p0 was declared lost; register again", "lost"))
    with pytest.raises(RouterLost, match="does not count this worker any more"):
        worker.poll_control()
    link.inbox.append(Error("", "Load from a peer that did not register", "not_registered"))
    with pytest.raises(RouterLost, match="not_registered"):   # a restarted router
        worker.poll_control()
    link.inbox.append(Registered(CFG.with_overrides(page_size=8).to_dict()))
    with pytest.raises(RouterLost, match=r"another config \(changed: \['page_size'\]\)"):
        worker._rejoin(RouterLost("declared lost"))
    worker.close()
    assert _frees(tmp_path) == [("a", "aborted"), ("b", "aborted")]


class _FailingRunner(ModelRunner):
    """A model runner whose next forward pass fails (a bug, a device error)."""

    fail = True

    def run(self, *args, **kwargs):
        if self.fail:
            self.fail = False
            raise RuntimeError("device lost")
        return super().run(*args, **kwargs)


def test_a_failing_prefill_pass_fails_its_requests_alone(prefill, tmp_path):
    worker, link = prefill
    worker.engine.runner = _FailingRunner(worker.model, worker.cache)
    worker.dispatch(_req("a", prompt(12, seed=1)))
    worker.dispatch(_req("b", prompt(12, seed=2)))
    worker.tick()
    assert [(m.rid, m.reason) for m in link.take(Prefilled)] == [("a", "error"),
                                                                 ("b", "error")]
    worker.dispatch(_req("c", prompt(12, seed=3)))
    worker.tick()                                              # the next pass runs
    assert worker.reqs["c"].num_computed == 8
    worker.close()
    assert _frees(tmp_path) == [("a", "error"), ("b", "error"), ("c", "aborted")]


def test_the_first_token_goes_to_the_router_before_the_draft_pass(tmp_path, model):
    # the first token depends on the target's logits alone: the client's TTFT does not
    # wait for the draft model's pass (before, Tokens went out after it)
    cfg = dataclasses.replace(CFG, spec_k=3)
    link = FakeLink()
    worker = PrefillWorker("p0", link, kv_bind=f"ipc://{tmp_path}/p0.sock",
                           log_dir=str(tmp_path))
    worker.start(cfg)
    try:
        assert worker.engine.with_draft
        runner = worker.engine.runner = DraftWatchingRunner(worker.runner, link)
        tokens = prompt(12, seed=1)
        worker.dispatch(_req("a", tokens))
        worker.tick()                              # positions 0-8: no first token yet
        worker.tick()                              # 8-12: the last chunk
        (first,) = link.tokens(take=True)
        assert first.ids == generate_greedy(model, [tokens], 1)[0][:1]
        assert runner.heard_at_draft == [[], ["a"]]
        assert worker.reqs["a"].state == ReqState.TRANSFERRING
        assert worker.reqs["a"].kv.committed_len == 12         # both passes ran
    finally:
        worker.close()
    assert _frees(tmp_path) == [("a", "aborted")]
