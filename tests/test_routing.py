"""Prefix-aware routing: the router's index from KV events, its scoring, conditional
disaggregation, and a real 2P2D deployment that routes conversations to their history.

The deployment story runs a closed-loop chat on 2P2D with prefix routing (float64 on
CPU): later turns go to their history, most are prefilled on their decode, every token
equals the single-process reference's, and a subscriber written from the format's
documentation rebuilds every worker's host tier from its events (compared with the
digest each worker reports as it closes). ``pdkv bench routing`` compares against
least-loaded.
"""

from __future__ import annotations

import pytest
import zmq

from common.auth import Keys, events_client
from common.config import ServeConfig
from common.host import HashChain
from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Lost
from common.metrics import render_snapshot
from common.model import Model, generate_greedy
from common.node import state_digest
from common.request import BadRequest
from deploy.launch.launcher import Cluster
from deploy.loadgen.conversation import ChatSpec, converse, make_conversations
from deploy.router.placement import Placement, WorkerInfo, pick
from deploy.router.prefix_index import Match, PrefixIndex
from deploy.router.prefix_routing import IMBALANCE, LOAD, PREFIX, Choice, Load, PrefixPolicy
from tests import kv_events_helpers as doc
from tests.metrics_helpers import parse

PS = 4


def stored(tokens, hashes, parent=None, medium="CPU"):
    return BlockStored(hashes, parent, tokens, PS, None, medium)


def batch(*events):
    return (0, EventBatch(1.0, list(events)))


def keys_of(tokens):
    return HashChain(PS, tokens=tokens).keys


# -- the index -------------------------------------------------------------------------
def test_the_index_follows_chains_by_their_tokens_not_the_workers_hashes():
    idx = PrefixIndex(PS)
    a = list(range(12))
    idx.apply("p0", batch(stored(a[:8], [11, 12]), stored(a[8:], [13], parent=12)))
    idx.apply("p1", batch(stored(a[:4], [99], medium="GPU"), stored(a[:8], [7, 8])))
    assert idx.match(keys_of(a), ["p0", "p1", "p2"]) == {
        "p0": Match(0, 3), "p1": Match(1, 2), "p2": Match()}
    assert idx.match(keys_of([9] + a[1:]), ["p0"]) == {"p0": Match()}  # first block differs
    idx.apply("p0", batch(BlockRemoved([13], "CPU")))
    assert idx.match(keys_of(a), ["p0"])["p0"] == Match(0, 2)
    idx.apply("p1", batch(AllBlocksCleared()))
    assert idx.match(keys_of(a), ["p1"])["p1"] == Match()


def test_what_the_index_cannot_trust_it_drops():
    idx = PrefixIndex(PS)
    a = list(range(8))
    idx.apply("p0", batch(stored(a[4:], [2], parent=1),             # parent never seen
                          BlockStored([3], None, [1, 2], 2, None, "CPU"),  # other block size
                          stored(a[:4], [4], medium="STORAGE")))      # a medium not indexed
    assert idx.num_dropped == 3 and idx.blocks() == {"p0": {"GPU": 0, "CPU": 0}}
    idx.apply("p0", batch(stored(a, [5, 6])))
    idx.apply("p0", Lost(3, 2))  # batches lost for good: whatever it held may be stale
    assert idx.match(keys_of(a + [0]), ["p0"])["p0"] == Match() and idx.num_resets == 1


# -- the scoring -----------------------------------------------------------------------
def policy(**changes):
    return PrefixPolicy(ServeConfig(page_size=PS, **changes))


def test_decode_goes_where_the_prompt_is_cached_unless_the_role_is_imbalanced():
    p = policy()
    loads = [Load("d0", 3, 900, 1000), Load("d1", 1, 100, 1000)]
    hit_on_d0 = [Match(0, 10), Match()]
    # 10 host blocks of 4 tokens, worth 0.8 of a device block each: 32 cached tokens
    assert p.decode(loads, hit_on_d0, 100) == Choice(0, PREFIX, 32, 0)
    assert p.decode(loads, [Match(), Match()], 100).index == 1  # no hit: least loaded
    busy = [Load("d0", 20, 900, 1000), Load("d1", 2, 100, 1000)]
    assert p.decode(busy, hit_on_d0, 100) == Choice(1, IMBALANCE)


def test_prefill_weighs_the_uncached_prompt_against_the_work_queued_on_it():
    p = policy(routing_host_weight=1.0)
    m = [Match(0, 100), Match()]  # 400 of a 500-token prompt cached on p0
    assert p.prefill([Load("p0", 1, 300, 10**4), Load("p1", 1, 0, 10**4)], m, 500).index == 0
    assert p.prefill([Load("p0", 2, 700, 10**4), Load("p1", 1, 0, 10**4)], m, 500).index == 1
    assert p.prefill([Load("p0", 0, 0, 10**4), Load("p1", 0, 0, 10**4)], [Match(), Match()],
                     500).reason == LOAD
    # 12 requests queued on p0 against 1: load alone, whatever p0 holds
    assert p.prefill([Load("p0", 12, 200, 10**4), Load("p1", 1, 100, 10**4)], m, 500) == \
        Choice(1, IMBALANCE)


def test_a_decode_holding_most_of_the_prompt_computes_a_short_rest_itself():
    p = policy(local_prefill_tokens=64)
    assert p.local(Match(0, 50), 240)          # 200 cached, 40 missing
    assert not p.local(Match(0, 50), 300)      # 100 missing: more than 64
    assert not p.local(Match(0, 5), 45)        # 20 cached, 25 missing: not most of it
    assert not policy(local_prefill_tokens=0).local(Match(0, 50), 201)  # off


def workers():
    ws = [WorkerInfo("d0", "decode", b"d0", pool_tokens=4000, ready=True),
          WorkerInfo("d1", "decode", b"d1", pool_tokens=4000, ready=True),
          WorkerInfo("p0", "prefill", b"p0", pool_tokens=4000, ready=True),
          WorkerInfo("p1", "prefill", b"p1", pool_tokens=4000, ready=True)]
    ws[0].assigned, ws[2].assigned = 50, 10  # d1 and p1 are the least loaded
    return ws


def test_placement_routes_a_prompt_to_the_workers_whose_events_hold_it():
    place = Placement(ServeConfig(page_size=PS, local_prefill_tokens=0))
    prompt = list(range(40))
    place.index.apply("d0", batch(stored(prompt[:32], list(range(8)))))
    place.index.apply("p0", batch(stored(prompt[:16], [1, 2, 3, 4])))
    chosen = place.pick(workers(), prompt, 60)  # p0: 40 - 12 cached + 10 queued < 40 + 0
    assert (chosen.decode.name, chosen.prefill.name, chosen.local) == ("d0", "p0", False)
    assert place.pick(workers(), [7] * 40, 60).decode.name == "d1"  # no hit: least loaded
    local = Placement(ServeConfig(page_size=PS, local_prefill_tokens=16))
    local.index.apply("d0", batch(stored(prompt[:32], list(range(8)))))
    chosen = local.pick(workers(), prompt, 60)
    assert (chosen.decode.name, chosen.prefill, chosen.local) == ("d0", None, True)
    with pytest.raises(BadRequest, match="no ready worker can hold"):
        local.pick(workers(), prompt, 5000)


def test_least_loaded_placement_is_the_old_choice():
    place = Placement(ServeConfig(page_size=PS, routing="least-loaded"))
    place.index.apply("d0", batch(stored(list(range(32)), list(range(8)))))  # ignored
    chosen = place.pick(workers(), list(range(40)), 60)
    assert (chosen.decode, chosen.prefill) == pick(workers(), 40, 60)
    assert (chosen.decode.name, chosen.prefill.name) == ("d1", "p1")


# -- a deployment ----------------------------------------------------------------------
CFG = ServeConfig(dtype="float64", page_size=PS, prefill_pages=160, decode_pages=260,
                  chunk_size=32, max_prefill_tokens=64, heartbeat_s=0.2, lease_s=3.0,
                  host_pages=300, local_prefill_tokens=24, debug_integrity=True)
CHAT = ChatSpec(conversations=8, clients=4, turns=(3, 4), first_len=(20, 60),
                user_len=(2, 12), reply_len=(4, 10), seed=5)


def _subscribers(cluster: Cluster, ctx: zmq.Context) -> dict[str, doc.DocSubscriber]:
    keys = Keys(cluster.keys_dir)
    auth = events_client(keys, "operator", "worker")

    def curve(sock):
        sock.curve_serverkey, sock.curve_publickey = auth.server_public, auth.public
        sock.curve_secretkey = auth.secret

    subs = {}
    for name, (addr, replay) in cluster.events_endpoints().items():
        subs[name] = doc.DocSubscriber(ctx, addr, replay, curve)
        subs[name].replay(0)  # it joined after the worker's first batches
    return subs


def _reference(convs, results, cfg) -> dict[str, list[int]]:
    """Each turn's greedy output, one at a time in this process, its prompt rebuilt from
    the conversation and the earlier turns' served replies."""
    model = Model(cfg.model_config())
    out = {}
    for conv in convs:
        prompt = list(conv.system)
        for t, (user, n) in enumerate(zip(conv.users, conv.reply_lens)):
            rid = f"chat-c{conv.cid:04d}-t{t}"
            prompt = prompt + user
            out[rid] = generate_greedy(model, [prompt], n, page_size=PS)[0]
            prompt = prompt + results[rid].output_ids
    return out


@pytest.mark.timeout(180)
def test_chat_goes_to_its_history_with_reference_tokens_and_events_rebuild_every_worker(
        tmp_path):
    """2P2D, prefix routing: later turns go to the decode that holds their history and
    most are computed there (no prefill); every token equals the reference's; every
    worker's host tier is rebuilt from its events."""
    ctx = zmq.Context()
    cluster = Cluster(CFG, "disagg", 2, 2, log_dir=str(tmp_path)).start()
    try:
        subs = _subscribers(cluster, ctx)
        convs = make_conversations(CHAT, CFG.model_config().vocab_size)
        results = converse(cluster.client, convs, CHAT.clients, check=cluster.check,
                           timeout_s=120)
        metrics = parse(render_snapshot(cluster.client.metrics())[0].decode())
    finally:
        stats = cluster.stop()
    try:
        cluster.check_exit_codes()
        for sub in subs.values():
            sub.follow()
    finally:
        for sub in subs.values():
            sub.close()
        ctx.destroy(linger=0)
    assert len(results) == sum(len(c.users) for c in convs)
    assert all(r.ok for r in results.values())
    assert {rid: r.output_ids for rid, r in results.items()} == \
        _reference(convs, results, CFG)   # a decode's own prefill changes no token

    later_turns = sum(1 for rid in results if not rid.endswith("-t0"))
    hit = sum(r.cached_tokens for r in results.values()) / \
        sum(r.prompt_len for r in results.values())
    assert hit > 0.6
    assert _sample(metrics, "pdkv_prefix_hit_ratio") == pytest.approx(hit, abs=1e-6)
    assert _sample(metrics, "pdkv_routing_decisions_total", stage="decode",
                   reason="prefix") >= later_turns - 2
    assert _sample(metrics, "pdkv_routing_decisions_total", stage="prefill",
                   reason="local") >= later_turns // 2
    for name, sub in subs.items():  # the state just before the last batch
        final = sub.cleared_states[-1]
        assert sub.state == {} and len(sub.cleared_states) >= 2, name
        assert len(sub.hashes("CPU", final)) == stats[name]["kv_events_cpu_blocks"] > 0, name
        assert state_digest(sub.hashes("CPU", final)) == \
            stats[name]["kv_events_cpu_digest"], name
        assert sub.hashes("GPU", final) == set(), name


def _sample(metrics, name: str, **labels) -> float:
    return sum(value for have, value in metrics.get(name, [])
               if all(have.get(k) == v for k, v in labels.items()))
