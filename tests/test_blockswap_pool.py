"""Pinned pool: hard cap, LRU eviction across owners, hit/miss counters, pinning fallback, platform caps (CPU)."""
import logging

import torch

from seedvr2bw.optimization.blockswap import FakeBackend, PinnedPool

GB = 1 << 30


def arena(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8)


def test_cap_and_hit_miss():
    be = FakeBackend()
    pool = PinnedPool(cap_bytes=300)
    a, b, c = arena(100), arena(100), arena(150)
    assert pool.add(1, "a", a, be)
    assert pool.add(1, "b", b, be)
    assert not pool.add(1, "c", c, be)              # over the cap: stays pageable, own entries not evicted
    assert pool.pinned_bytes == 200 and be.is_pinned(a) and not be.is_pinned(c)
    assert pool.touch(1, "a") and not pool.touch(1, "c")
    st = pool.stats()
    assert st["hits"] == 1 and st["misses"] == 1 and st["evictions"] == 0
    assert pool.release_owner(1) == 200
    assert pool.pinned_bytes == 0 and not be.pinned


def test_lru_evicts_other_owner_least_recent_first():
    be = FakeBackend()
    pool = PinnedPool(cap_bytes=300)
    x1, x2, x3 = arena(100), arena(100), arena(100)
    synced = []
    pool.add(1, "x1", x1, be)
    pool.add(1, "x2", x2, be, sync=lambda: synced.append("x2"))
    pool.add(2, "y", arena(50), be)
    pool.touch(1, "x1")                              # x2 is now the least recently used of owner 1
    new = arena(100)
    assert pool.add(3, "z", new, be)                 # needs 50 more bytes: evicts x2 (LRU), not x1
    assert not be.is_pinned(x2) and be.is_pinned(x1) and be.is_pinned(new)
    assert synced == ["x2"]                          # in-flight copies waited for before unpinning
    assert pool.stats()["evictions"] == 1
    assert pool.pinned_bytes <= pool.cap_bytes


def test_no_self_eviction_scan_resistant():
    """A forward pass touches blocks cyclically; the pool must not unpin/re-pin its own blocks every pass."""
    be = FakeBackend()
    pool = PinnedPool(cap_bytes=250)
    arenas = [arena(100) for _ in range(4)]
    for i, a in enumerate(arenas):
        pool.add(7, i, a, be)
    pinned_before = [be.is_pinned(a) for a in arenas]
    assert pinned_before == [True, True, False, False]
    for _ in range(3):
        for i in range(4):
            pool.touch(7, i)
    assert [be.is_pinned(a) for a in arenas] == pinned_before
    assert sum(1 for e in be.log if e[0] == "pin") == 2 and not any(e[0] == "unpin" for e in be.log)
    st = pool.stats()
    assert st["hits"] == 6 and st["misses"] == 6


def test_repin_on_miss_when_room_appears():
    be = FakeBackend()
    pool = PinnedPool(cap_bytes=200)
    a, b = arena(150), arena(150)
    pool.add(1, "a", a, be)
    assert not pool.add(2, "b", b, be) or True
    # owner 2 was added after owner 1 filled it -> b evicted a (LRU, other owner)
    assert be.is_pinned(b) and not be.is_pinned(a)
    pool.release_owner(2)
    assert pool.touch(1, "a")                        # miss, but room now: pinned again
    assert be.is_pinned(a)


def test_owner_cap():
    be = FakeBackend()
    pool = PinnedPool(cap_bytes=10_000)
    pool.set_owner_cap(1, 250)
    got = [pool.add(1, i, arena(100), be) for i in range(4)]
    assert got == [True, True, False, False]
    assert pool.owner_pinned_bytes(1) == 200


def test_pin_failure_falls_back_and_logs(caplog):
    be = FakeBackend(pin_fail=True)
    pool = PinnedPool(cap_bytes=1 << 30)
    with caplog.at_level(logging.WARNING):
        assert not pool.add(1, "a", arena(100), be)
        assert not pool.add(1, "b", arena(100), be)
    assert pool.stats()["pin_failures"] == 1                               # no retry after a failure
    assert pool.pinned_bytes == 0
    assert sum("pinning failed" in r.message for r in caplog.records) == 1   # logged once per owner
    assert not pool.touch(1, "a")


def test_global_pool_cap_from_hardware_policy(monkeypatch):
    from seedvr2bw.optimization.blockswap import pool as poolmod
    from seedvr2bw.optimization.runtime import policy

    class P:
        pinned_pool_bytes = 123 * GB

    monkeypatch.setattr(policy, "get_policy", lambda device=None, *a, **k: P())
    poolmod.reset_pinned_pool()
    assert poolmod.get_pinned_pool().cap_bytes == 123 * GB
    poolmod.reset_pinned_pool()
