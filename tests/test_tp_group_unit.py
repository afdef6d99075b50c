"""A tensor-parallel group's transport agreement, in one process (transport/group.py):
rank 0's ``GroupSender`` holds its endpoint's COMPLETED until every rank's part is done,
turns a follower's failure into FAILED with that follower's reason, gives up with
``timeout`` past the deadline, and records every call that starts or stops a transfer
for the followers. The group is a real subclass of ``TpGroup`` (one process: the
followers' statuses are what the test says they are); a follower's ``RankSender`` keeps
each rid's status from its own endpoint's events."""

from __future__ import annotations

import time

from common.kv import KvCache, KvLayout
from common.node.tp import Lockstep, TpKvOp
from common.node.tp.lockstep import CODEC, OP_CODEC
from common.parallel import TpGroup
from transport import Event, EventKind, GroupSender, RankSender, TransportConfig
from transport.group import DONE, PENDING, failed, reason_of


class Followers(TpGroup):
    """Rank 0 of a group whose followers answer with ``statuses`` (rid -> status)."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.statuses: dict[str, int] = {}
        self.steps: list = []
        self.asked: list[list[str]] = []

    def broadcast_bytes(self, tag, payload, idle=None):
        self.steps.append(CODEC.decode(payload))
        return payload

    def all_min(self, values):
        rids = self.steps[-1].owners
        self.asked.append(list(rids))
        return [min(v, self.statuses.get(rid, PENDING)) for v, rid in zip(values, rids)]

    def gather_bytes(self, payload):
        return [payload, b"ipc:///tmp/p0.tp1.kv"]

    def ops(self) -> list[tuple[str, str, str]]:
        return [(o.op, o.owner, o.text) for s in self.steps
                for o in map(OP_CODEC.decode, s.ops)]


class Endpoint:
    """An endpoint whose ``poll`` answers what the test queued (isolates the wrapper)."""

    def __init__(self, chunk_timeout_s: float = 60.0) -> None:
        self.config = TransportConfig(chunk_timeout_s=chunk_timeout_s)
        self.cache = KvCache(16, 4, layout=KvLayout(num_layers=2))
        self.queued: list[Event] = []
        self.calls: list[tuple] = []
        self.address = "ipc:///tmp/p0.kv"

    def poll(self, timeout_s=0.0):
        out, self.queued = self.queued, []
        return out

    def expect(self, rid, cap):
        self.calls.append(("expect", rid, cap))

    def send(self, rid, kv, upto):
        self.calls.append(("send", rid, upto))
        return True

    def finish(self, rid, kv, first_token):
        self.calls.append(("finish", rid, first_token))
        return True

    def abort(self, rid, reason="aborted", detail=""):
        self.calls.append(("abort", rid, reason))
        return True


def _sender(chunk_timeout_s: float = 60.0) -> tuple[GroupSender, Endpoint, Followers]:
    group, real = Followers(), Endpoint(chunk_timeout_s)
    lockstep = Lockstep(group)
    return GroupSender(real, lockstep, real.address), real, group


def _flush(sender: GroupSender) -> None:
    sender._lockstep.keepalive()  # what the worker does after every tick


def test_statuses_carry_the_reason_both_ways():
    for reason in ("aborted", "timeout", "error", "peer_lost"):
        assert failed(reason) < 0 and reason_of(failed(reason)) == reason
    assert reason_of(failed("no such reason")) == "error"


def test_completed_waits_for_every_rank_and_the_ops_reach_the_followers():
    sender, real, group = _sender()
    assert sender.rank_addresses == ["ipc:///tmp/p0.kv", "ipc:///tmp/p0.tp1.kv"]
    sender.expect("r1", "cap1")
    sender.send("r1", None, 8)
    sender.finish("r1", None, 42)
    _flush(sender)
    assert group.ops() == [("x_expect", "r1", "cap1"), ("x_send", "r1", ""),
                           ("x_finish", "r1", "")]
    assert [c[0] for c in real.calls] == ["expect", "send", "finish"]
    done = Event(EventKind.COMPLETED, "r1", reason="sent", first_token=42)
    real.queued.append(done)
    assert sender.poll() == []          # rank 1 has not finished its legs
    assert group.asked == [["r1"]]
    assert sender.poll() == []          # asked again, still under way
    group.statuses["r1"] = DONE
    assert sender.poll() == [done]      # every rank done: the worker frees "sent"
    assert sender.poll() == [] and group.asked[-1] == ["r1"]  # nothing left to ask


def test_a_follower_that_lost_its_peer_fails_the_request_with_that_reason():
    sender, real, group = _sender()
    real.queued.append(Event(EventKind.COMPLETED, "r2", reason="sent", first_token=7))
    group.statuses["r2"] = failed("peer_lost")
    (ev,) = sender.poll()
    assert (ev.kind, ev.rid, ev.reason) == (EventKind.FAILED, "r2", "peer_lost")
    assert "another tensor-parallel rank" in ev.detail
    _flush(sender)
    assert ("x_abort", "r2", "peer_lost") in group.ops()  # the other followers stop too


def test_no_verdict_within_the_deadline_fails_with_timeout():
    sender, real, group = _sender(chunk_timeout_s=0.05)
    real.queued.append(Event(EventKind.COMPLETED, "r3", reason="sent", first_token=1))
    assert sender.poll() == []
    time.sleep(0.06)
    (ev,) = sender.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, "timeout")


def test_an_abort_drops_the_held_completion_and_a_failure_on_rank_0_reaches_the_followers():
    sender, real, group = _sender()
    real.queued.append(Event(EventKind.COMPLETED, "r4", reason="sent", first_token=1))
    assert sender.poll() == []
    sender.abort("r4", "aborted", "client abort")
    group.statuses["r4"] = DONE
    assert sender.poll() == []           # aborted meanwhile: never completed
    lost = Event(EventKind.FAILED, "r5", reason="peer_lost", detail="decode lost")
    real.queued.append(lost)
    assert sender.poll() == [lost]
    _flush(sender)
    assert [o for o in group.ops() if o[0] == "x_abort"] == [
        ("x_abort", "r4", "aborted"), ("x_abort", "r5", "peer_lost")]


def test_a_follower_keeps_each_rids_status_from_its_own_endpoint():
    real = Endpoint()
    rank = RankSender(real, "p0/tp1")
    # no row here: this rank's part fails, never the rank
    rank.apply(OP_CODEC.decode(OP_CODEC.encode(_op("x_send", "r1", n=8))), None)
    assert rank.status("r1") == failed("error") and real.calls == []
    rank.apply(_op("x_expect", "r2", text="cap"), None)  # before any row: fine
    rank.apply(_op("x_finish", "r2", n=5), object())
    assert real.calls == [("expect", "r2", "cap"), ("finish", "r2", 5)]
    assert rank.status("r2") == PENDING
    real.queued = [Event(EventKind.COMPLETED, "r2", prompt_len=9, cached_tokens=4,
                         path="shm"),
                   Event(EventKind.FAILED, "r3", reason="timeout")]
    rank.poll(0)
    assert (rank.status("r2"), rank.status("r3")) == (DONE, failed("timeout"))
    # counted as rank 0 counts its own: 3 pages of the prompt less 1 the decode held,
    # in bytes of this rank's heads; the failed transfer is not counted
    page_bytes = real.cache.layout.page_bytes(4)
    (done,) = rank.take_completed()
    assert done[:3] == ("sent", 2, 2 * page_bytes) and done[4] == "shm" and done[3] >= 0
    assert rank.take_completed() == [] and "r2" not in rank.finished
    rank.forget("r2")
    assert rank.status("r2") == PENDING


def _op(op: str, owner: str, **kw) -> TpKvOp:
    return TpKvOp(op, owner, **kw)
