"""Retraction policy stories (``decode_node.retraction.Retractor``) over a real pool, host
tier and model: the youngest running sequence is retracted first, the oldest retracted one
resumes first and before any new admission, with exact page counts; outputs equal the
reference and both free logs replay clean.

Pool: 11 pages of 4 slots (10 usable). Three 12-token prompts (3 pages each) leave 1 page
free; greedy decoding (spec_k 0) takes one new page per sequence every 4 steps.
"""

from __future__ import annotations

from common.model import generate_greedy
from decode_node.retraction import Retractor
from tests.model_helpers import prompt
from tests.test_host_connector import Node, SwitchEngine, frees

MAX_NEW = {"a": 10, "b": 16, "c": 16}


def _setup(model, tmp_path):
    engine = SwitchEngine()
    engine.auto = True  # copies end at once; pins drop at the next poll
    n = Node(model, tmp_path, 4, num_pages=11, host_pages=60, engine=engine)
    for rid, max_new in MAX_NEW.items():  # a is the oldest, c the youngest
        n.admit(rid, prompt(12, seed=ord(rid)), max_new)
    n.conn.poll()
    return n, Retractor(n.conn, n.batch, spec_k=0)


def _rids(reqs) -> list[str]:
    return [r.rid for r in reqs]


def _offloaded_owners(n) -> list[str]:
    from common.freelog import FreeLogReader
    return [ev["owner"] for ev in FreeLogReader(n.device_log).records
            if ev.get("op") == "free" and ev.get("reason") == "offloaded"]


def test_youngest_is_retracted_first_and_oldest_resumes_first(model, tmp_path):
    n, ret = _setup(model, tmp_path)
    assert n.cache.num_free_pages() == 1 and ret.pages_short() == 2  # 3 needed
    assert ret.admits_new()

    # c (youngest) goes; its 3 pages come back at once (their copies already ended)
    assert _rids(ret.relieve()) == ["c"]
    assert n.cache.num_free_pages() == 4 and list(ret.waiting) == ["c"]
    assert not ret.admits_new()                      # c waits: nothing new is admitted

    # c needs 4 pages (12 committed positions + 1 step) but a and b need 2 of the 4
    # free ones for their next step: it stays retracted
    assert ret.resume(n.runner, 5) == ([], {})
    for _ in range(8):                               # a and b to position 20
        assert _rids(ret.relieve()) == []
        n.step()
    assert n.cache.num_free_pages() == 0 and ret.pages_short() == 2

    # the youngest *running* one is b; a (oldest) keeps its row
    assert _rids(ret.relieve()) == ["b"]
    # b's 5 pages: [0, 16) at once, [16, 20) (just filled) once its copy to the host ends
    assert n.cache.num_free_pages() == 4
    n.conn.poll()
    assert n.cache.num_free_pages() == 5
    assert list(ret.waiting) == ["b", "c"]           # oldest first, though c left first
    n.step()                                         # a reaches max_new_tokens
    n.conn.poll()
    assert list(n.outputs) == ["a"] and n.cache.num_free_pages() == 10

    # b needs 6 pages (20 committed + 1 step), then c 4 (12 + 1) of 10: both fit, b
    # first; each new row spans its committed tokens (5 + 3 pages)
    seqs, failed = ret.resume(n.runner, 5)
    assert [s.rid for s in seqs] == ["b", "c"] and failed == {} and ret.admits_new()
    assert n.cache.num_free_pages() == 2
    for s in seqs:
        assert n.batch.add(s)

    # b is older than c again (its age survived retraction): c is the next victim
    _run_to_the_end(n, ret)
    assert n.outputs == {rid: generate_greedy(model, [prompt(12, seed=ord(rid))], mx)[0]
                         for rid, mx in MAX_NEW.items()}
    n.close_and_replay()
    offloaded = frees(n.device_log, "offloaded")
    assert _offloaded_owners(n) == ["c", "b", "c"]
    assert [len(pages) for pages in offloaded] == [3, 5, 4]


def _run_to_the_end(n, ret) -> None:
    """The decode worker's loop: resume (oldest first), relieve, step."""
    while len(n.batch) or ret.waiting:
        for s in ret.resume(n.runner, 5)[0]:
            assert n.batch.add(s)
        ret.relieve()
        n.step()
        n.conn.poll()


def test_abort_while_retracted_drops_the_host_reference_only(model, tmp_path):
    n, ret = _setup(model, tmp_path)
    assert _rids(ret.relieve()) == ["c"]
    assert n.conn.offloader.prefix.evict(100) == 6         # a's and b's; c's chain is referenced
    assert ret.discard(n.reqs["c"]) and not ret.discard(n.reqs["c"]) and ret.admits_new()
    assert n.conn.offloader.prefix.evict(100) == 3         # c's 3 host pages may go now
    _run_to_the_end(n, ret)
    assert set(n.outputs) == {"a", "b"}
    n.close_and_replay()
