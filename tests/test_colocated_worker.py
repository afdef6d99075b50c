"""The colocated worker in process, over a fake router link (no network): the first token
leaves as soon as the target's pass sampled it, once, and the request decodes on to the
reference's tokens; the free log replays clean."""

from __future__ import annotations

from common.config import ServeConfig
from common.control import Done, Req, pack_ids
from common.freelog import FreeLogReader, replay_file
from common.model import generate_greedy
from deploy.launch.colocated import ColocatedWorker
from tests.fakes import FakeLink
from tests.model_helpers import DraftWatchingRunner, prompt

CFG = ServeConfig(dtype="float64", page_size=4, decode_pages=64, chunk_size=8,
                  max_prefill_tokens=16, spec_k=3, offload=False, heartbeat_s=0.2,
                  lease_s=3.0)


def test_the_first_token_goes_out_before_the_draft_pass_and_only_once(tmp_path, model):
    # as on a prefill worker: the client's TTFT does not wait for the draft's KV (before,
    # start_decoding sent the first token after both passes); the reference deployment
    # of `pdkv bench hops` gets the same early send as the 1P1D it is compared with
    link = FakeLink()
    worker = ColocatedWorker("c0", link, log_dir=str(tmp_path))
    worker.start(CFG)
    tokens = prompt(12, seed=1)
    try:
        assert worker.engine.with_draft
        runner = worker.engine.runner = DraftWatchingRunner(worker.runner, link)
        worker.dispatch(Req("a", pack_ids(tokens), {"max_new_tokens": 6}, prefill="",
                            prefill_addr="", decode="c0"))
        while not any(isinstance(m, Done) for m in link.sent):
            worker.tick()
        assert runner.heard_at_draft[:2] == [[], ["a"]]   # chunks 0-8, then 8-12
        streamed = link.tokens(take=True)
        assert [m.first for m in streamed].count(True) == 1 and streamed[0].first
        ids = [t for m in streamed for t in m.ids]
        assert ids == generate_greedy(model, [tokens], 6)[0]
        (done,) = link.take(Done)
        assert done.reason == "length"
    finally:
        worker.close()
    report = replay_file(tmp_path / "c0.freelog")
    assert report.ok, report.format()
    frees = {e["reason"] for e in FreeLogReader(tmp_path / "c0.freelog").records
             if e.get("op") == "free"}
    assert frees == {"finished"}, frees
