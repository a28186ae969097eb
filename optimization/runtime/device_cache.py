"""Device tensors the ops share between layers (lookup tables, the dequantized-weight scratch, kernel workspaces).

They are worth keeping while a model of the pack is alive and are garbage once none is: ComfyUI's unload and the
node cache's reset must leave no byte of ours on the GPU. So every shared cache is made here, every model the pack
builds takes a lease on them, and when the last leased model is collected every cache is emptied (and the tensors
go back to torch's allocator, which ComfyUI's ``soft_empty_cache`` then returns to the driver)."""
from __future__ import annotations

import threading
import weakref

_CACHES: list[dict] = []
_lock = threading.Lock()
_leases = 0


def cache() -> dict:
    """A new module-level dict of device tensors, emptied by :func:`clear` (and when the last lease ends)."""
    d: dict = {}
    _CACHES.append(d)
    return d


def clear() -> None:
    """Drop every shared device tensor now (the next call that needs one makes it again)."""
    for d in _CACHES:
        d.clear()


def lease(owner) -> None:
    """Keep the shared tensors while ``owner`` (a model) lives; the last owner's collection clears them."""
    global _leases
    with _lock:
        _leases += 1
    weakref.finalize(owner, _end_lease)


def leases() -> int:
    return _leases


def _end_lease() -> None:
    global _leases
    with _lock:
        _leases -= 1
        last = _leases == 0
    if last:
        clear()
