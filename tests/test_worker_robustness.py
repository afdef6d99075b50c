"""No single request stops a worker: a reused request id, a request that cannot be read,
a duplicate, a request moved away by the router. Workers in process over a fake router
link; every free log replays clean.

The first story is sglang's unit-test case for a reused rid with a pending copy: a
finished request's row stays open until its host copies end, and a new request with the
same id, sent in that window, once reached ``open_row``'s "owner already has an open
row" inside admission, which nothing guarded, so the worker's loop ended.
"""

from __future__ import annotations

import time

from common.config import ServeConfig
from common.control import Abort, Done, Error, Prefilled, Req, pack_ids
from common.freelog import FreeLogReader, replay_file
from common.model import generate_greedy
from deploy.launch.colocated import ColocatedWorker
from prefill_node.worker import PrefillWorker
from tests.fakes import FakeLink
from tests.model_helpers import prompt

CFG = ServeConfig(dtype="float64", page_size=4, decode_pages=64, prefill_pages=64,
                  chunk_size=8, max_prefill_tokens=16, spec_k=0, offload=True,
                  host_pages=64, heartbeat_s=0.2, lease_s=3.0)


def _req(rid: str, tokens: list[int], n: int = 6, **kw) -> Req:
    return Req(rid, pack_ids(tokens), {"max_new_tokens": n}, prefill="", prefill_addr="",
               decode="c0", **kw)


def _run_until_done(worker, link: FakeLink, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(isinstance(m, Done) for m in link.sent) < count:
        assert time.monotonic() < deadline, link.sent
        worker.tick()


def _frees(path) -> list[tuple[str, str]]:
    with FreeLogReader(path) as log:
        return [(e["owner"], e["reason"]) for e in log.records if e.get("op") == "free"]


def test_a_reused_rid_with_a_pending_host_copy_is_served_as_a_new_row(tmp_path, model):
    link = FakeLink()
    worker = ColocatedWorker("c0", link, log_dir=str(tmp_path))
    worker.start(CFG.with_overrides(debug_copy_delay_s=0.3))   # copies end late
    tokens = prompt(13, seed=7)
    want = generate_greedy(model, [tokens], 6)[0]
    try:
        worker.dispatch(_req("r", tokens))
        _run_until_done(worker, link, 1)
        assert worker.cache.has_row("r")          # finished, its row held for the copies
        worker.dispatch(_req("r", tokens))        # the same id again, in that window
        _run_until_done(worker, link, 2)          # the loop lives on and serves it
        dones = link.take(Done)
        assert [(d.rid, d.reason) for d in dones] == [("r", "length"), ("r", "length")]
        ids = [t for m in link.tokens(take=True) for t in m.ids]
        assert ids == want + want
    finally:
        worker.close()
    report = replay_file(tmp_path / "c0.freelog")
    assert report.ok, report.format()
    assert [f for f in _frees(tmp_path / "c0.freelog") if f[0] == "r"] == [
        ("r", "finished"), ("r", "finished")]


def test_a_request_moved_away_is_freed_migrated_and_resumes_at_its_step(tmp_path, model):
    """The router moves a request: the worker that had it frees its row ``migrated``;
    the next one gets the prompt plus the tokens streamed so far (``prior``) and goes on
    with the same tokens a run without the move gives, sampled ones included (the draws
    are a function of seed and step), also when its first token is sampled in a mixed
    step beside another request's decode."""
    tokens = prompt(11, seed=3)
    link = FakeLink()
    worker = ColocatedWorker("c0", link, log_dir=str(tmp_path))
    worker.start(CFG.with_overrides(offload=False))
    try:
        for i, params in enumerate(({}, {"temperature": 0.9, "seed": 5})):
            whole = _req("whole", tokens, 8)
            whole = Req(**{**whole.__dict__, "params": {"max_new_tokens": 8, **params}})
            worker.dispatch(whole)
            _run_until_done(worker, link, 1)
            ref = [t for m in link.tokens(take=True) for t in m.ids]
            link.take(Done)
            moving = f"moving#r-{i}"
            worker.dispatch(Req(**{**whole.__dict__, "rid": moving, "label": "moving"}))
            while len([t for m in link.tokens() for t in m.ids]) < 3:
                worker.tick()
            worker.dispatch(Abort(moving, "migrated"))
            (gone,) = link.take(Done)
            assert gone.reason == "migrated"
            streamed = [t for m in link.tokens(take=True) for t in m.ids]
            k = len(streamed)
            # another request decoding meanwhile: the next attempt's first token is
            # sampled in a mixed step (its prompt's last chunk beside that decode)
            worker.dispatch(_req(f"other{i}", prompt(9, seed=11), 24))
            while not link.tokens():
                worker.tick()
            worker.dispatch(Req(f"{moving}~1", pack_ids(tokens + streamed),
                                {"max_new_tokens": 8 - k, **params}, prefill="",
                                prefill_addr="", decode="c0", label="moving", prior=k))
            _run_until_done(worker, link, 2)
            rest = [t for m in link.tokens(take=True) for t in m.ids
                    if m.rid == f"{moving}~1"]
            link.take(Done)
            assert streamed + rest == ref, params
            if not params:
                assert ref == generate_greedy(model, [tokens], 8)[0]
    finally:
        worker.close()
    report = replay_file(tmp_path / "c0.freelog")
    assert report.ok, report.format()
    assert ("moving#r-0", "migrated") in _frees(tmp_path / "c0.freelog")
    assert report.migrated == ["moving#r-0", "moving#r-1"]


def test_a_prefill_refuses_a_bad_or_duplicate_request_alone_and_serves_on(tmp_path):
    link = FakeLink()
    worker = PrefillWorker("p0", link, kv_bind=f"ipc://{tmp_path}/p0.sock",
                           log_dir=str(tmp_path))
    worker.start(CFG)
    try:
        good = Req("a", pack_ids(prompt(9, seed=1)), {"max_new_tokens": 4}, prefill="p0",
                   prefill_addr="", decode="d0", eager=True)
        worker.dispatch(good)
        worker.dispatch(good)                                  # the same id again
        worker.dispatch(Req("b", b"\x01\x02\x03", {}, prefill="p0", prefill_addr="",
                            decode="d0"))                      # ids that are not int32s
        worker.dispatch(Req("c", pack_ids([1, 2]), {"bogus": 1}, prefill="p0",
                            prefill_addr="", decode="d0"))     # unknown parameter
        errors = link.take(Error)
        assert [(e.rid, e.code) for e in errors] == [("a", "refused"), ("b", "refused"),
                                                     ("c", "refused")]
        assert "already in flight" in errors[0].error and "bogus" in errors[2].error
        worker.tick()
        assert list(worker.reqs) == ["a"] and worker.reqs["a"].kv is not None
        worker.dispatch(Abort("a", "migrated"))
        (ended,) = link.take(Prefilled)
        assert (ended.rid, ended.reason) == ("a", "migrated")
        assert worker.counts["migrated"] == 1
    finally:
        worker.close()
    report = replay_file(tmp_path / "p0.freelog")
    assert report.ok, report.format()
    assert _frees(tmp_path / "p0.freelog") == [("a", "migrated")]
