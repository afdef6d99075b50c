"""Property: any interleaving of offloads, loads, copy completions, aborts and finishes
loads exactly the KV that was stored, leaks nothing, and both free logs replay clean."""

from __future__ import annotations

import hashlib

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common import KvCache, KvLayout
from common.freelog import replay_file
from common.host import HashChain, HostTier, Offloader
from tests.test_offload import ManualEngine

LAYOUT = KvLayout(num_layers=1, num_kv_heads=1, head_dim=2)
PS = 2
PREFIXES = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 9])


def page_kv(key: bytes) -> torch.Tensor:
    """The KV a page holds, a function of its key: same prefix, same KV (like a model)."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
    return torch.randn(LAYOUT.page_shape(PS), generator=torch.Generator().manual_seed(seed))


ops = st.lists(st.tuples(st.sampled_from(["open", "store", "load", "run", "commit", "abort",
                                          "finish", "evict"]),
                         st.integers(0, 5)), max_size=40)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
@example([("open", 0), ("commit", 0), ("store", 0), ("run", 0), ("open", 0)])
@example([("open", 1), ("store", 0), ("open", 1), ("abort", 0), ("run", 0), ("open", 1)])
def test_random_offload_histories_are_exact_and_replay_clean(tmp_path_factory, history):
    tmp = tmp_path_factory.mktemp("offload")
    cache = KvCache(24, PS, layout=LAYOUT, max_rows=8, log_path=tmp / "device.pdkvlog")
    host = HostTier(6, PS, LAYOUT, log_path=tmp / "host.pdkvlog")
    engine = ManualEngine()
    off = Offloader(cache, host, engine=engine)
    live: dict[str, tuple] = {}  # rid -> (kv, chain, tokens)
    loads = []
    for n, (op, arg) in enumerate(history):
        rids = sorted(live)
        rid = rids[arg % len(rids)] if rids else None
        if op == "open" and len(live) < 4:
            tokens = PREFIXES[arg % 3] + [arg] * (arg % 3)
            kv = cache.open_row(f"r{n}")
            if cache.num_free_pages() < 4:
                cache.close_row(kv)
                continue
            cache.extend(kv, len(tokens))
            chain = HashChain(PS, tokens=tokens)
            hit = off.lookup(chain) // PS  # those pages must come from the host: zero them
            cache.data()[cache.pages(kv, 0, len(tokens))] = 0
            for i, key in enumerate(chain.keys[hit:], start=hit):
                cache.data()[cache.pages(kv, i * PS, i * PS + 1)] = page_kv(key)
            live[kv.owner] = (kv, chain, tokens)
            if arg % 2:  # a prompt that prefill computed: committed, offloaded at once
                cache.commit(kv, len(tokens))
                off.prepare_store(kv, chain)
            h = off.prepare_load(kv, chain)
            if h is not None:
                loads.append((h, [page_kv(k) for k in h.keys]))
        elif op == "commit" and rid:
            kv = live[rid][0]
            cache.commit(kv, kv.allocated_len - kv.committed_len)
        elif op == "store" and rid:
            off.prepare_store(live[rid][0], live[rid][1])
        elif op == "run":
            engine.run_all()
            off.poll()
        elif op == "evict":
            off.prefix.evict(arg)
        elif op in ("abort", "finish") and rid:
            kv = live.pop(rid)[0]
            if op == "finish":
                engine.run_all()
                assert off.wait(kv, timeout=1)
            cache.free_kv_row(kv, [(0, kv.allocated_len)],
                              reason="aborted" if op == "abort" else "finished")
            cache.close_row(kv)
        off.check_integrity()
    engine.run_all()
    off.poll()
    for h, expected in loads:
        assert h.done
        if h.owner in live:  # aborted rows' pages may be reused: only live ones are exact
            got = cache.data()[h.device_pages]
            assert torch.equal(got, torch.stack(expected)), h.owner
    for kv, _, _ in live.values():
        cache.free_kv_row(kv, [(0, kv.allocated_len)])
        cache.close_row(kv)
    assert off.close(timeout=1)
    cache.check_integrity()
    assert cache.num_free_pages() == 23
    assert host.num_free + len(off.prefix) == 5
    cache.close()
    host.close()
    for log in ("device.pdkvlog", "host.pdkvlog"):
        report = replay_file(tmp / log)
        assert report.ok, report.format()
