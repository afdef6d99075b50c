"""Prefix cache stories: the hash chain, longest-prefix lookup, LRU eviction of leaves."""

from __future__ import annotations

import numpy as np
import pytest

from common.freelog import FreeLogReader, replay_file
from common.host import CACHE_OWNER, HashChain, HostTier, PrefixCache


@pytest.fixture
def host(tmp_path):
    h = HostTier(7, 2, log_path=tmp_path / "host.pdkvlog")  # 6 usable pages
    yield h
    h.close()
    report = replay_file(tmp_path / "host.pdkvlog")
    assert report.ok, report.format()


def cache_chain(cache: PrefixCache, tokens: list[int]) -> tuple[HashChain, list[int]]:
    """Insert every full page of ``tokens`` not cached yet; returns the chain, new pages."""
    chain = HashChain(2, tokens=tokens)
    start = cache.num_cached(chain.keys)
    pages = cache.host.allocate(len(chain) - start)
    cache.insert(chain.keys[start:], pages, chain.keys[start - 1] if start else None)
    return chain, pages.tolist()


def evicted_pages(log_path) -> list[list[int]]:
    reader = FreeLogReader(log_path)
    return [np.frombuffer(ev["pages"], "<i4").tolist() for ev in reader.records
            if ev.get("op") == "free" and ev.get("reason") == "evicted"]


def test_hash_chain_keys_full_pages_only_and_extends_incrementally():
    chain = HashChain(4, tokens=[1, 2, 3, 4, 5, 6])
    assert len(chain) == 1 and chain.num_tokens == 6  # the partial page has no key
    chain.extend([7, 8, 9])
    assert chain.keys == HashChain(4, tokens=range(1, 10)).keys
    assert len(chain) == 2 and len(set(chain.keys)) == 2


def test_same_tokens_after_a_different_prefix_do_not_match():
    a = HashChain(4, tokens=[1, 2, 3, 4, 5, 6, 7, 8])
    b = HashChain(4, tokens=[9, 9, 9, 9, 5, 6, 7, 8])
    assert a.keys[1] != b.keys[1]  # page 1 holds the same tokens, but after another page
    assert HashChain(4, salt=b"model-b", tokens=[1, 2, 3, 4]).keys[0] != a.keys[0]


def test_lookup_returns_the_longest_cached_prefix(host):
    cache = PrefixCache(host)
    chain, pages = cache_chain(cache, [1, 2, 3, 4, 5, 6])
    assert pages == [1, 2, 3]
    longer = HashChain(2, tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.match(longer.keys).tolist() == [1, 2, 3]
    forked = HashChain(2, tokens=[1, 2, 3, 0, 5, 6])
    assert cache.match(forked.keys).tolist() == [1]
    assert cache.num_cached(HashChain(2, tokens=[7, 7]).keys) == 0
    cache.check_integrity()


def test_full_pool_evicts_least_recently_used_leaves_first(host, tmp_path):
    cache = PrefixCache(host)
    a, a_pages = cache_chain(cache, [1, 1, 2, 2])  # pages 1, 2
    b, b_pages = cache_chain(cache, [3, 3, 4, 4])  # pages 3, 4
    c, c_pages = cache_chain(cache, [5, 5, 6, 6])  # pages 5, 6: the pool is full
    assert (a_pages, b_pages, c_pages) == ([1, 2], [3, 4], [5, 6]) and host.num_free == 0
    cache.match(a.keys)  # a is used again: b is now the least recently used
    assert cache.evict(1) == 1  # b's leaf (page 4); its parent (page 3) becomes a leaf
    assert cache.evict(2) == 2  # then b's first page, then c's leaf
    assert cache.num_cached(b.keys) == 0 and cache.num_cached(c.keys) == 1
    assert cache.num_cached(a.keys) == 2
    cache.check_integrity()
    host.close()
    assert evicted_pages(tmp_path / "host.pdkvlog") == [[4], [3, 6]]


def test_a_referenced_chain_is_never_evicted_nor_its_ancestors(host):
    cache = PrefixCache(host)
    a, _ = cache_chain(cache, [1, 1, 2, 2, 3, 3])  # pages 1, 2, 3
    b, _ = cache_chain(cache, [1, 1, 2, 2, 4, 4])  # shares pages 1, 2; page 4
    cache.ref(a.keys[1])  # protects pages 1 and 2 (page 2 is a's second page)
    assert cache.evict(10) == 2  # only the leaves: pages 3 and 4
    assert cache.num_cached(a.keys) == 2 and len(cache) == 2
    cache.unref(a.keys[1])
    assert cache.evict(10) == 2
    assert len(cache) == 0 and host.num_free == 6
    cache.check_integrity()


def test_chain_stays_consistent_when_a_parent_is_shared():
    host = HostTier(8, 1)
    cache = PrefixCache(host)
    first = HashChain(1, tokens=[5, 6, 7])
    cache.insert(first.keys, host.allocate(3), None)
    other = HashChain(1, tokens=[5, 6, 8])
    cache.insert(other.keys[2:], host.allocate(1), other.keys[1])
    cache.match(first.keys)
    assert cache.evict(1) == 1  # the other leaf, page 4: the shared parent keeps a child
    assert cache.num_cached(other.keys) == 2
    assert cache.evict(1) == 1 and cache.num_cached(first.keys) == 2
    cache.check_integrity()
    assert host.owners_holding_pages() == {CACHE_OWNER: 2}
