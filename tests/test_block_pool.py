"""Block pool: ref counts, LRU eviction order, prefix-cache hits, verification and stale entries."""
import pytest

from pyengine.engine.block_pool import BlockPool

BS = 4


def toks(n, start=0):
    return list(range(start, start + n))


def test_allocate_free_refcounts():
    pool = BlockPool(8, BS)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 5
    pool.touch(a[:1])
    assert pool.ref_count(a[0]) == 2
    pool.free_blocks(a)
    assert pool.num_free == 7 and pool.ref_count(a[0]) == 1
    pool.free_blocks(a[:1])
    assert pool.num_free == 8 and pool.usage == 0.0
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(9)
    with pytest.raises(RuntimeError, match="freed more"):
        pool.free_blocks([0])


def test_lru_eviction_order_and_uncached_first():
    pool = BlockPool(4, BS)
    seqs = []
    for i in range(2):  # two sequences of two full blocks each, cached
        t = toks(8, 100 * i)
        blocks, hashes = pool.allocate(2), []
        assert pool.cache_full_blocks(t, hashes, blocks, 0, 8) == 2
        seqs.append((t, blocks))
    pool.free_blocks(seqs[0][1])  # older
    pool.free_blocks(seqs[1][1])  # newer
    assert pool.num_cached_blocks == 4 and pool.num_free == 4
    # Evicts seq 0 first, and within it the tail block first (freed in reverse order).
    got = pool.allocate(1)
    assert got == [seqs[0][1][1]]
    # The evicted block dropped its hash: seq 0 now hits only its first block.
    assert pool.lookup(seqs[0][0] + [1], []) == [seqs[0][1][0]]
    assert pool.lookup(seqs[1][0] + [1], []) == seqs[1][1]
    # An uncached freed block is reused before any cached one.
    pool.free_blocks(got)
    assert pool.allocate(1) == got


def test_prefix_hit_capped_and_verified():
    pool = BlockPool(8, BS)
    t = toks(8)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(t, [], blocks, 0, 8)
    # Exactly two full blocks: the hit leaves the last token to compute -> only block 0.
    assert pool.lookup(t, []) == blocks[:1]
    assert pool.lookup(t + [99], []) == blocks
    # Different first block -> chained hash differs -> no hit for the second block either.
    assert pool.lookup([7] + t[1:] + [99], []) == []


def test_hash_collision_is_verified(monkeypatch):
    pool = BlockPool(8, BS)
    t = toks(5)
    blocks = pool.allocate(2)
    hashes = []
    pool.cache_full_blocks(t, hashes, blocks, 0, 4)
    # A different sequence whose precomputed hash list claims the same hash must not hit.
    other = toks(5, 50)
    assert pool.lookup(other, list(hashes)) == []
    assert pool.lookup(t, []) == blocks[:1]


def test_no_caching_mode():
    pool = BlockPool(4, BS, enable_caching=False)
    t = toks(9)
    b = pool.allocate(2)
    assert pool.cache_full_blocks(t, [], b, 0, 8) == 0
    assert pool.lookup(t, []) == []
