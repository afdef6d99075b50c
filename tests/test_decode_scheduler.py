"""The decode scheduler in process: a request's whole life on a decode, its one end at
every stage, prefix reuse and its timeout policy. Real pool, model (float64) and host
tier; the transport is played by the test (it computes the prompt's KV, as a prefill
would have sent it). Every free log replays clean."""

from __future__ import annotations

import pytest

from common.config import ServeConfig
from common.control import Done, Message, StepTokens, Tokens
from common.freelog import FreeLogReader, replay_file
from common.kv import KvCache
from common.model import BatchItem, ModelRunner, generate_greedy
from common.request import ReqState, Request, SamplingParams
from decode_node.scheduler import DecodeScheduler
from tests.model_helpers import prompt

CFG = ServeConfig(dtype="float64", page_size=4, decode_pages=64, spec_k=2, host_pages=64,
                  max_running=8)


class Decode:
    """A decode node in miniature: the scheduler, and the test as its transport."""

    def __init__(self, model, tmp_path, cfg: ServeConfig = CFG) -> None:
        self.log = tmp_path / "d.freelog"
        self.cache = KvCache(cfg.decode_pages, cfg.page_size, node="d", log_path=self.log,
                             layout=cfg.model_config().kv_layout(with_draft=cfg.with_draft))
        self.runner = ModelRunner(model, self.cache)
        self.sent: list[Message] = []
        self.stopped: list[tuple[str, str]] = []
        self.sched = DecodeScheduler("d", cfg, self.cache, self.runner, self.sent.append,
                                     self._stop, device="cpu", log_dir=str(tmp_path),
                                     who="decode d", instead="receiving",
                                     whole_life=not cfg.overcommit)

    def _stop(self, req: Request, reason: str, detail: str) -> None:
        self.stopped.append((req.rid, reason))

    def submit(self, rid: str, tokens: list[int], max_new: int, **params) -> Request:
        req = Request(rid, tokens, SamplingParams(max_new_tokens=max_new, **params))
        self.sched.enqueue(req)
        return req

    def admit(self) -> list[Request]:
        out = []
        while (req := self.sched.admit_next(commit_prefix=False)) is not None:
            self.sched.waiting_kv(req)
            out.append(req)
        return out

    def arrive(self, req: Request) -> None:
        """The transfer ends: the prompt's KV (target and draft) lands, with the first
        token, and the request starts decoding."""
        start = req.num_computed
        item = BatchItem(req.kv, req.prompt[start:], start)
        first = int(self.runner.forward([item])[0].argmax())
        self.runner.forward([item], draft=True)
        self.cache.commit(req.kv, req.prompt_len)
        req.output.append(first)
        self.sched.start_decoding(req)

    def run(self) -> None:
        while self.sched.step():
            self.sched.reap()

    def done(self) -> dict[str, Done]:
        return {m.rid: m for m in self.sent if isinstance(m, Done)}

    def outputs(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for m in self.sent:
            for t in m.items() if isinstance(m, StepTokens) else [m]:
                if isinstance(t, Tokens):
                    out.setdefault(t.rid, []).extend(t.ids)
        return out

    def close_and_frees(self) -> list[dict]:
        self.sched.abort_all()
        self.sched.close()
        for log in (self.log, self.log.with_name("d.host.freelog")):
            report = replay_file(log)
            assert report.ok, report.format()
        return [e for e in FreeLogReader(self.log).records if e.get("op") == "free"]


def test_a_request_lives_queued_waiting_decoding_finished_and_is_freed_once(model,
                                                                           tmp_path):
    d = Decode(model, tmp_path)
    a, b = d.submit("a", prompt(13, seed=1), 9), d.submit("b", prompt(6, seed=2), 1)
    assert a.state == ReqState.QUEUED and d.admit() == [a, b]
    assert a.state == b.state == ReqState.WAITING_KV and a.kv.allocated_len == 13
    d.arrive(a)
    d.arrive(b)                       # one token wanted: finished at its first token
    assert b.state == ReqState.FINISHED and d.done()["b"] == Done("b", "length", n=1)
    assert a.state == ReqState.DECODING
    d.run()
    assert a.state == ReqState.FINISHED and d.done()["a"] == Done("a", "length", n=9)
    assert d.outputs()["a"] == generate_greedy(model, [prompt(13, seed=1)], 9)[0]
    assert d.sched.find("a") is None and a.kv is None and not d.stopped
    frees = d.close_and_frees()
    assert sorted((f["owner"], f["reason"]) for f in frees) == [("a", "finished"),
                                                                ("b", "finished")]


@pytest.mark.parametrize("stage", ["queued", "waiting_kv", "decoding"])
def test_an_abort_at_any_stage_ends_the_request_in_one_place(model, tmp_path, stage):
    d = Decode(model, tmp_path)
    req = d.submit("a", prompt(10, seed=3), 20)
    if stage != "queued":
        d.admit()
    if stage == "decoding":
        d.arrive(req)
        d.sched.step()
    d.sched.end(req, "aborted")
    assert req.state == ReqState.ABORTED and d.done()["a"] == Done("a", "aborted")
    assert d.stopped == ([("a", "aborted")] if stage == "waiting_kv" else [])
    assert d.sched.find("a") is None and not len(d.sched.batch)
    frees = d.close_and_frees()
    assert [(f["owner"], f["reason"]) for f in frees] == (
        [] if stage == "queued" else [("a", "aborted")])


def test_a_transport_failure_is_freed_with_its_free_reason(model, tmp_path):
    d = Decode(model, tmp_path)
    req = d.submit("a", prompt(10, seed=3), 5)
    d.admit()
    d.sched.end(req, "bad_range", "the prefill sent pages outside the announce")
    assert req.state == ReqState.FAILED
    assert d.done()["a"].error == "the prefill sent pages outside the announce"
    assert [f["reason"] for f in d.close_and_frees()] == ["error"]


def test_a_follow_up_turn_loads_the_shared_prefix_from_the_host_tier(model, tmp_path):
    d = Decode(model, tmp_path)
    p1 = prompt(21, seed=4)
    first = d.submit("t1", p1, 8)
    d.admit()
    d.arrive(first)
    d.run()
    d.sched.offloader.wait(None, 5)
    p2 = p1 + d.outputs()["t1"] + prompt(5, seed=5)
    second = d.submit("t2", p2, 6)
    d.admit()
    assert second.num_computed == 28                 # 7 full pages of the first turn
    assert d.sched.prefix_reuse.num_hit_pages == 7
    d.arrive(second)
    d.run()
    assert d.outputs()["t2"] == generate_greedy(model, [p2], 6)[0]
    d.close_and_frees()


def test_a_prefix_load_past_its_deadline_frees_the_row_and_requeues_without_reuse(
        model, tmp_path):
    # every host copy starts 0.5 s late: a load cannot end within 0.05 s
    d = Decode(model, tmp_path, CFG.with_overrides(debug_copy_delay_s=0.5,
                                                   prefix_load_timeout_s=0.05))
    p = prompt(17, seed=6)
    first = d.submit("t1", p, 3)
    d.admit()
    d.arrive(first)
    d.run()
    assert d.sched.offloader.wait(None, 10)
    again = d.submit("t2", p, 3)
    assert d.admit() == [again]                      # admitted again at once, in a new row
    assert not again.reuse and again.num_computed == 0
    assert d.sched.prefix_reuse.num_timeouts == 1
    d.arrive(again)
    d.run()
    assert d.outputs()["t2"] == generate_greedy(model, [p], 3)[0]
    reasons = [(f["owner"], f["reason"]) for f in d.close_and_frees()]
    # t1's free waited for its copies to the host tier; t2 was freed twice, in two rows
    assert sorted(reasons) == [("t1", "finished"), ("t2", "finished"), ("t2", "timeout")]


def test_a_failing_step_fails_the_batchs_requests_and_the_worker_serves_on(model,
                                                                          tmp_path):
    d = Decode(model, tmp_path)
    a = d.submit("a", prompt(9, seed=7), 6)
    d.admit()
    d.arrive(a)
    good = d.sched.batch.step_fn

    def broken(runner, reqs):
        raise FloatingPointError("NaN in the logits")

    d.sched.batch.step_fn = broken
    assert d.sched.step()
    assert a.state == ReqState.FAILED and "NaN in the logits" in d.done()["a"].error
    d.sched.batch.step_fn = good
    b = d.submit("b", prompt(9, seed=7), 6)
    d.admit()
    d.arrive(b)
    d.run()
    assert d.outputs()["b"] == generate_greedy(model, [prompt(9, seed=7)], 6)[0]
    assert sorted(f["reason"] for f in d.close_and_frees()) == ["error", "finished"]


@pytest.mark.parametrize("stage", ["waiting_kv", "decoding"])
def test_a_stop_from_the_router_finishes_the_request_and_frees_it_finished(model, tmp_path,
                                                                          stage):
    """A stop string cut at the router: a decoding request finishes at once; one whose
    prompt's KV is still arriving finishes as it would start decoding (the transfer is
    not cut, so its prefill ends as always). Either way ``stop`` and ``finished``."""
    d = Decode(model, tmp_path)
    req = d.submit("a", prompt(10, seed=3), 20)
    d.admit()
    if stage == "decoding":
        d.arrive(req)
        d.sched.step()
    d.sched.stop(req)
    if stage == "waiting_kv":
        assert req.state == ReqState.WAITING_KV and not d.done()   # the KV still lands
        d.arrive(req)
    assert req.state == ReqState.FINISHED and d.done()["a"].reason == "stop"
    assert d.sched.find("a") is None and not len(d.sched.batch) and not d.stopped
    assert d.sched.counts["finished"] == 1 and d.sched.counts["aborted"] == 0
    assert [(f["owner"], f["reason"]) for f in d.close_and_frees()] == [("a", "finished")]


def test_a_stop_while_retracted_finishes_as_the_request_resumes(model, tmp_path):
    """Under pressure the younger request is retracted to the host tier; stopped there, it
    finishes (``stop``, ``finished``) when it resumes instead of decoding on."""
    cfg = CFG.with_overrides(decode_pages=13, overcommit=True)
    d = Decode(model, tmp_path, cfg)
    old, young = d.submit("old", prompt(16, seed=8), 30), d.submit("young", prompt(16, seed=9),
                                                                   30)
    d.admit()
    d.arrive(old)
    d.arrive(young)
    while young.state != ReqState.RETRACTED:
        assert d.sched.step(), "no retraction happened"
        d.sched.reap()
    d.sched.stop(young)
    assert young.state == ReqState.RETRACTED and "young" not in d.done()
    while d.sched.find("young") is not None or d.sched.find("old") is not None:
        d.sched.reap()
        d.sched.resume()
        d.sched.step()
    assert d.done()["young"].reason == "stop" and d.done()["old"].reason == "length"
    reasons = sorted((f["owner"], f["reason"]) for f in d.close_and_frees())
    assert ("young", "finished") in reasons and ("young", "aborted") not in reasons
    assert reasons.count(("young", "offloaded")) == 1
