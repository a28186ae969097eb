"""Pinned host-memory pool: a hard byte cap, LRU eviction across owners, hit/miss counters, pageable fallback.

Entries are host arenas (one per swapped block) registered in place (`cudaHostRegister`) -- never a second
host copy. The pool only decides *whether* an arena is pinned; an unpinned arena still works (pageable copies,
slower, logged once per owner).

Eviction policy: least recently used entries of *other* owners (models) are unpinned to make room; an owner
never evicts its own entries. A forward pass touches every swapped block in order, and LRU on such a cyclic
scan would unpin/re-pin every block on every pass (each pin costs ~27 ms per 453 MB) -- so within one model
the set pinned at attach (or later when room appears) stays pinned, and the rest stays pageable.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..runtime import policy

_log = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class _Entry:
    owner: int
    key: object
    tensor: torch.Tensor
    nbytes: int
    backend: object
    pinned: bool
    sync: Optional[Callable[[], None]]   # waits for copies still reading the memory (called before unpinning)


class PinnedPool:
    """Host arenas keyed by (owner, key); at most `cap_bytes` of them pinned at once."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = int(cap_bytes)
        self._entries: "OrderedDict[tuple, _Entry]" = OrderedDict()   # LRU order: first = least recent
        self._lock = threading.RLock()
        self.pinned_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.pin_failures = 0
        self._warned_owners: set = set()
        self._owner_caps: dict[int, Optional[int]] = {}
        self._failed_owners: set = set()   # a failed pin stops further attempts for that owner (WDDM: one
                                           # failed pin poisons later ones; no retries on the hot path)

    # ------------------------------------------------------------------ accounting
    def owner_pinned_bytes(self, owner: int) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.owner == owner and e.pinned)

    def set_owner_cap(self, owner: int, cap: Optional[int]) -> None:
        self._owner_caps[owner] = cap

    def stats(self) -> dict:
        with self._lock:
            return {
                "cap_bytes": self.cap_bytes, "pinned_bytes": self.pinned_bytes,
                "entries": len(self._entries), "pinned_entries": sum(e.pinned for e in self._entries.values()),
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "pin_failures": self.pin_failures,
            }

    def is_pinned(self, owner: int, key) -> bool:
        e = self._entries.get((owner, key))
        return bool(e and e.pinned)

    # ------------------------------------------------------------------ registration
    def add(self, owner: int, key, tensor: torch.Tensor, backend, sync=None, pin: bool = True) -> bool:
        """Register an arena; try to pin it within the caps. Returns whether it is pinned."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if (owner, key) in self._entries:
                self.remove(owner, key)
            e = _Entry(owner, key, tensor, nbytes, backend, False, sync)
            self._entries[(owner, key)] = e
            if pin:
                self._try_pin(e)
            return e.pinned

    def touch(self, owner: int, key, repin: bool = True) -> bool:
        """Mark an entry used (LRU) and count a hit (pinned) or a miss (pageable). On a miss, try to pin it
        if room can be made without evicting this owner's own entries."""
        with self._lock:
            e = self._entries.get((owner, key))
            if e is None:
                self.misses += 1
                return False
            self._entries.move_to_end((owner, key))
            if e.pinned:
                self.hits += 1
                return True
            self.misses += 1
            if repin and e.backend is not None and e.owner not in self._failed_owners and self._room_possible(e):
                self._try_pin(e)
            return e.pinned

    def remove(self, owner: int, key) -> None:
        with self._lock:
            e = self._entries.pop((owner, key), None)
            if e is not None:
                self._unpin(e)

    def release_owner(self, owner: int) -> int:
        """Unpin and forget every entry of `owner`; returns the bytes unpinned."""
        with self._lock:
            freed = 0
            for k in [k for k, e in self._entries.items() if e.owner == owner]:
                e = self._entries.pop(k)
                if e.pinned:
                    freed += e.nbytes
                self._unpin(e)
            self._owner_caps.pop(owner, None)
            self._warned_owners.discard(owner)
            self._failed_owners.discard(owner)
            return freed

    # ------------------------------------------------------------------ internals
    def _owner_room(self, e: _Entry) -> bool:
        cap = self._owner_caps.get(e.owner)
        return cap is None or self.owner_pinned_bytes(e.owner) + e.nbytes <= cap

    def _room_possible(self, e: _Entry) -> bool:
        if not self._owner_room(e):
            return False
        evictable = sum(x.nbytes for x in self._entries.values() if x.pinned and x.owner != e.owner)
        return self.pinned_bytes - evictable + e.nbytes <= self.cap_bytes

    def _try_pin(self, e: _Entry) -> None:
        if e.pinned or e.nbytes == 0 or e.owner in self._failed_owners:
            return
        if not self._owner_room(e) or e.nbytes > self.cap_bytes:
            self._warn(e, "pinned cap reached")
            return
        # evict least recently used entries of other owners until it fits
        if self.pinned_bytes + e.nbytes > self.cap_bytes:
            for k, x in list(self._entries.items()):
                if self.pinned_bytes + e.nbytes <= self.cap_bytes:
                    break
                if x.pinned and x.owner != e.owner:
                    self._unpin(x)
                    self.evictions += 1
            if self.pinned_bytes + e.nbytes > self.cap_bytes:
                self._warn(e, "pinned cap reached")
                return
        if e.backend.pin(e.tensor):
            e.pinned = True
            self.pinned_bytes += e.nbytes
        else:
            self.pin_failures += 1
            self._failed_owners.add(e.owner)
            self._warn(e, "pinning failed")

    def _unpin(self, e: _Entry) -> None:
        if not e.pinned:
            return
        if e.sync is not None:
            try:
                e.sync()          # a copy may still be reading this memory
            except Exception as exc:  # noqa: BLE001
                _log.warning("[SeedVR2-BW] sync before unpin failed: %s", exc)
        try:
            e.backend.unpin(e.tensor)
        finally:
            e.pinned = False
            self.pinned_bytes -= e.nbytes

    def _warn(self, e: _Entry, why: str) -> None:
        if e.owner in self._warned_owners:
            return
        self._warned_owners.add(e.owner)
        _log.warning("[SeedVR2-BW] BlockSwap: %s (%.2f of %.2f GiB pinned): some blocks are copied from pageable "
                     "memory, which is slower and blocks the host during the copy", why,
                     self.pinned_bytes / GiB, self.cap_bytes / GiB)


_owner_ids = itertools.count(1)


def new_owner() -> int:
    """A fresh owner id for the pool (one per model or runner that registers arenas)."""
    return next(_owner_ids)


_global_pool: Optional[PinnedPool] = None
_global_lock = threading.Lock()


def get_pinned_pool(device=None) -> PinnedPool:
    """The process-wide pool; cap = the hardware policy's `pinned_pool_bytes` (runtime/device.py has the rule)."""
    global _global_pool
    with _global_lock:
        if _global_pool is None:
            cap = policy.get_policy(device).pinned_pool_bytes
            _global_pool = PinnedPool(cap)
            _log.info("[SeedVR2-BW] pinned pool cap %.2f GiB", cap / GiB)
        return _global_pool


def reset_pinned_pool() -> None:
    """Forget the process-wide pool (tests); the next ``get_pinned_pool`` makes a new one."""
    global _global_pool
    with _global_lock:
        _global_pool = None
