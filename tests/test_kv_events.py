"""KV events in vLLM's format: the bytes, the stream, replay, gaps, keys, and a worker's host
tier rebuilt from its events after 1,000 requests with offloads and evictions.

The subscriber that checks them is written from the format's documentation
(``tests/kv_events_helpers.py``: vLLM's msgspec structs, a SUB socket, the replay socket)
and never imports pdkv's subscriber.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from common import KvCache, KvLayout
from common.auth import INSECURE, InsecureBind, Keys, create_keys, events_client, events_server
from common.host import HashChain, HostTier, Offloader
from common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    EventsFormatError,
    EventStream,
    Lost,
    decode_batch,
    encode_batch,
    external_hash,
    replay_address,
)
from common.node import EventsSpec, WorkerEvents, state_digest
from tests import kv_events_helpers as doc

pytestmark = pytest.mark.timeout(120)
LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                  num_draft_layers=0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


# -- the bytes -----------------------------------------------------------------------------
def test_a_batch_is_byte_for_byte_what_vllms_own_structs_encode():
    ours = EventBatch(1722.25, [
        AllBlocksCleared(),
        BlockStored([2**64 - 1, 7], None, list(range(8)), 4, None, "CPU"),
        BlockStored([9], 7, [5, 5, 5, 5], 4, None, "GPU"),
        BlockRemoved([9, 2**64 - 1], "CPU")], 0)
    theirs = doc.KVEventBatch(1722.25, [
        doc.AllBlocksCleared(),
        doc.BlockStored([2**64 - 1, 7], None, list(range(8)), 4, None, "CPU"),
        doc.BlockStored([9], 7, [5, 5, 5, 5], 4, None, "GPU"),
        doc.BlockRemoved([9, 2**64 - 1], "CPU")], 0)
    assert encode_batch(ours) == msgspec.msgpack.encode(theirs)
    assert doc.DECODER.decode(encode_batch(ours)) == theirs
    assert decode_batch(msgspec.msgpack.encode(theirs)) == ours


def test_later_vllms_tagged_maps_decode_too_and_bad_fields_are_named():
    class Stored(msgspec.Struct, tag="BlockStored"):  # no array_like: a tagged map
        block_hashes: list[bytes]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = "x"
        extra_keys: list | None = None

    class Batch(msgspec.Struct, array_like=True):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    digest = bytes(range(32))
    payload = msgspec.msgpack.encode(Batch(2.0, [Stored([digest], -1, [1, 2], 2, None, "GPU"),
                                                 ["SomethingNew", 1]], 3))
    batch = decode_batch(payload)
    # bytes hashes fold to their last 8 bytes, a signed parent to its unsigned value
    assert batch.events == [BlockStored([int.from_bytes(digest[-8:], "big")], 2**64 - 1,
                                        [1, 2], 2, None, "GPU")]
    assert batch.data_parallel_rank == 3
    for bad, words in [(b"\xc1", "not msgpack"), (msgspec.msgpack.encode([1.0, 5]), "list"),
                       (encode_batch(EventBatch(1.0, [BlockStored([1], None, [1], 4)])),
                        "1 token ids for 1 blocks of 4")]:
        with pytest.raises(EventsFormatError, match=words):
            decode_batch(bad)


def test_a_block_hash_is_the_keys_last_8_bytes_big_endian():
    key = bytes(range(16))
    assert external_hash(key) == int.from_bytes(bytes(range(8, 16)), "big")


# -- the stream ----------------------------------------------------------------------------
def test_a_gap_is_detected_and_filled_from_the_replay_socket(tmp_path, ctx):
    pub = EventPublisher(f"ipc://{tmp_path}/ev")
    sub = doc.DocSubscriber(ctx, pub.address, pub.replay_address, drop={3, 4, 7})
    plain = doc.DocSubscriber(ctx, pub.address, pub.replay_address)
    time.sleep(0.3)  # both subscriptions are in place before the first batch
    try:
        for i in range(10):  # one batch each: flush before the next
            pub.publish(BlockStored([100 + i], 99 + i if i else None, [i] * 4, 4, None, "CPU"))
            assert pub.flush()
        sub.follow()
        plain.follow()
        assert sub.gaps == [(3, 5), (7, 8)]
        assert sub.last_seq == plain.last_seq == 9
        assert sub.state == plain.state and len(sub.hashes()) == 10
        assert sub.tokens_of(109) == [i for i in range(10) for _ in range(4)]
    finally:
        sub.close()
        plain.close()
        pub.close()


def test_pdkvs_stream_catches_up_what_a_full_pipe_dropped(tmp_path, ctx):
    pub = EventPublisher(f"ipc://{tmp_path}/ev", hwm=1)
    stream = EventStream(ctx, pub.address, pub.replay_address)
    stream.sub.setsockopt(zmq.RCVHWM, 1)
    try:
        assert stream.receive() == []  # the first replay: nothing published yet
        time.sleep(0.3)
        for i in range(300):
            pub.publish(BlockRemoved([i], "CPU"))
            pub.flush()
        seqs, deadline = [], time.monotonic() + 20
        while len(seqs) < 300 and time.monotonic() < deadline:
            seqs += [item[0] for item in stream.receive()]
            time.sleep(0.01)
        assert seqs == list(range(300))
        assert stream.num_gaps > 0 and stream.num_lost == 0  # the pipe did drop some
    finally:
        stream.close()
        pub.close()


def test_a_subscriber_that_joins_late_catches_up_and_one_past_the_ring_is_told(tmp_path, ctx):
    pub = EventPublisher(f"ipc://{tmp_path}/ev", buffer_steps=5)
    try:
        for i in range(3):
            pub.publish(BlockRemoved([i], "CPU"))
            pub.flush()
        late = EventStream(ctx, pub.address, pub.replay_address)
        assert [item[0] for item in late.receive()] == [0, 1, 2]
        late.close()
        for i in range(3, 20):
            pub.publish(BlockRemoved([i], "CPU"))
            pub.flush()
        later = EventStream(ctx, pub.address, pub.replay_address)
        items = later.receive()
        assert items[0] == Lost(0, 15)
        assert [item[0] for item in items[1:]] == list(range(15, 20))
        later.close()
    finally:
        pub.close()


def test_publish_only_queues_the_events_are_built_on_the_publishers_thread(tmp_path):
    pub = EventPublisher(f"ipc://{tmp_path}/ev")
    built_on = []

    class Pending:
        def events(self):
            built_on.append(threading.current_thread().name)
            return [AllBlocksCleared()]

    try:
        pub.publish(Pending())
        assert pub.flush()
        assert built_on == ["kv-events"] and pub.next_seq == 1
    finally:
        pub.close()


# -- keys ----------------------------------------------------------------------------------
def test_with_keys_only_router_and_operator_identities_subscribe(tmp_path, ctx):
    create_keys(tmp_path / "keys", clients=["client"])
    keys = Keys(tmp_path / "keys")
    pub = EventPublisher("tcp://127.0.0.1:*", auth=events_server(keys, "worker"))
    try:
        def curve(identity):
            auth = events_client(keys, identity, "worker")
            return lambda sock: (setattr(sock, "curve_serverkey", auth.server_public),
                                 setattr(sock, "curve_publickey", auth.public),
                                 setattr(sock, "curve_secretkey", auth.secret))

        subs = {who: doc.DocSubscriber(ctx, pub.address, pub.replay_address, curve(who))
                for who in ("router", "operator", "client")}
        subs["nobody"] = doc.DocSubscriber(ctx, pub.address, pub.replay_address)
        time.sleep(0.5)
        pub.publish(AllBlocksCleared())
        pub.flush()
        got = {who: s.poll(1.0) for who, s in subs.items()}
        assert got == {"router": 1, "operator": 1, "client": 0, "nobody": 0}
        assert subs["router"].replay(0) == 0  # answered (its one batch is applied already)
        with pytest.raises(TimeoutError):
            subs["client"].replay(0, timeout_s=0.5)
        for s in subs.values():
            s.close()
    finally:
        pub.close()
    with pytest.raises(InsecureBind):
        EventPublisher("tcp://0.0.0.0:*", auth=INSECURE)


# -- a worker's host tier, rebuilt ---------------------------------------------------------
class HostTierWorkload:
    """A worker's device pool, host tier and offloader, publishing its KV events, driven by
    seeded requests that share prefixes (hits, chains that grow) on a host tier small
    enough to evict all along."""

    def __init__(self, tmp_path, ctx, page_size=4, host_pages=48):
        self.ps = page_size
        self.cache = KvCache(64, page_size, layout=LAYOUT)
        self.host = HostTier(host_pages, page_size, LAYOUT)
        self.off = Offloader(self.cache, self.host)
        self.events = WorkerEvents(EventsSpec(f"ipc://{tmp_path}/w0.events"), INSECURE, ctx)
        self.events.watch(self.off, page_size)
        self.rng = np.random.default_rng(7)
        self.systems = [self.rng.integers(0, 500, int(n)).tolist()
                        for n in self.rng.integers(4, 24, 6)]
        self.conversations: list[list[int]] = []

    def prompt(self) -> list[int]:
        if self.conversations and self.rng.random() < 0.5:  # a conversation's next turn
            i = int(self.rng.integers(len(self.conversations)))
            self.conversations[i] += self.rng.integers(0, 500, int(self.rng.integers(1, 12))
                                                       ).tolist()
            return list(self.conversations[i][:120])
        system = self.systems[int(self.rng.integers(len(self.systems)))]
        prompt = system + self.rng.integers(0, 500, int(self.rng.integers(1, 40))).tolist()
        self.conversations = (self.conversations + [prompt])[-20:]
        return list(prompt)

    def request(self, i: int) -> None:
        """Open a row, load its cached prefix, commit, offload (in two steps for some
        requests: a chain that extends its own parent), wait for the copies, free."""
        tokens = self.prompt()
        chain = HashChain(self.ps, b"salt", tokens)
        kv = self.cache.open_row(f"r{i}")
        self.cache.extend(kv, len(tokens))
        load = self.off.prepare_load(kv, chain, max_tokens=len(tokens) - 1)
        if load is not None:
            assert self.off.complete_load(load, 10)
        half = len(tokens) // 2 if i % 3 == 0 else len(tokens)
        self.cache.commit(kv, half)
        self.off.prepare_store(kv, chain)
        self.cache.commit(kv, len(tokens) - half)
        self.off.prepare_store(kv, chain)
        assert self.off.wait(kv, 10)
        self.cache.free_kv_row(kv, [(0, kv.allocated_len)], reason="finished")
        self.cache.close_row(kv)

    def check(self, sub: doc.DocSubscriber, state: dict | None = None) -> None:
        """The subscriber's CPU blocks are exactly the prefix cache's, each with its parent,
        and its tokens hash (the worker's chain) to the worker's own key."""
        cached = self.off.prefix.keys()
        by_hash = {external_hash(k): k for k in cached}
        assert sub.hashes("CPU", state) == set(by_hash)
        assert sub.hashes("GPU", state) == set()  # the device keeps no prefix cache
        blocks = (sub.state if state is None else state)["CPU"]
        for h, key in by_hash.items():
            parent = cached[key]
            assert blocks[h][0] == (None if parent is None else external_hash(parent))
            assert HashChain(self.ps, b"salt", sub.tokens_of(h, "CPU", state)).keys[-1] == key
        assert sub.block_sizes <= {self.ps}

    def close(self) -> None:
        assert self.off.close(10)
        self.off.check_integrity()
        self.cache.check_integrity()
        self.events.close()


def test_a_subscriber_rebuilds_the_host_tier_after_1000_requests_and_a_late_one_too(
        tmp_path, ctx):
    w = HostTierWorkload(tmp_path, ctx)
    addr, replay = w.events.addresses
    early = doc.DocSubscriber(ctx, addr, replay)
    late = None
    time.sleep(0.3)
    try:
        for i in range(1000):
            w.request(i)
            if i % 50 == 0:
                early.poll()  # keep up as a live subscriber does
            if i == 500:
                late = doc.DocSubscriber(ctx, addr, replay)
                late.replay(0)  # joins halfway: everything from the first batch
        assert w.events.publisher.flush()
        early.follow()
        late.follow()
        assert w.off.prefix.num_evicted > 100 and w.off.num_offloaded_pages > 500
        assert w.off.num_loaded_pages > 100  # hits: the workload reuses prefixes
        w.check(early)
        w.check(late)
        assert early.state == late.state
        stats = w.events.state()
        assert stats["kv_events_cpu_blocks"] == len(early.hashes())
        assert stats["kv_events_cpu_digest"] == state_digest(early.hashes())
        before = {medium: dict(blocks) for medium, blocks in early.state.items()}
        w.close()  # the last batch: every block is gone
        early.follow()
        assert early.state == {} and early.cleared_states[-1] == before
        assert len(early.cleared_states) == 2  # the first batch and the last
    finally:
        early.close()
        if late is not None:
            late.close()


def test_a_worker_refuses_an_events_address_others_could_reach_before_it_starts():
    env = {k: v for k, v in os.environ.items() if k != "PDKV_AUTH_KEYS"}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "decode", "--router",
                           "ipc:///nonexistent/router.sock", "--kv-events-endpoint",
                           "tcp://0.0.0.0:5999"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr
    assert "refusing to bind tcp://0.0.0.0:5999 without authentication" in done.stderr


def test_the_replay_socket_sits_beside_the_events_socket():
    assert replay_address("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert replay_address("tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"
    assert replay_address("ipc:///run/w0.events") == "ipc:///run/w0.events.replay"
    with pytest.raises(ValueError, match="give tcp://HOST:PORT or ipc://PATH"):
        replay_address("udp://127.0.0.1:5557")
