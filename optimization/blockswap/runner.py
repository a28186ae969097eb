"""BlockSwapRunner: streams swapped blocks through a ring of preallocated GPU buffers.

Design (why: docs/ARCHITECTURE.md, "Block runner"):
* each swapped block's tensors live in one page-aligned host arena (its stored dtypes), pinned in place through
  the pool (cap, LRU across models, pageable fallback);
* one copy stream and a ring of `buffers` GPU slots, each the size of the largest swapped block, allocated once;
* before block i runs, the copies of the next `prefetch` swapped blocks are issued into free slots: the copy
  stream waits (on the GPU) for the event marking the end of the compute that last used the slot, copies,
  records `ready[slot]`; the compute stream waits `ready[slot]`, and the block's parameters/buffers are
  re-pointed at views of the slot (`t.data = view`). No host waits, no allocations, no `record_stream`, and the
  weights are never copied back: releasing a block re-points its tensors at the host arena again;
* at the end of an inference pass the first swapped blocks of the next pass are prefetched (wrap-around), since
  SeedVR2 runs one forward per batch;
* forward hooks on every swapped module are a safety net (a block called outside `iterate` still gets its
  weights) and the training path: under gradient checkpointing the recomputation in backward re-materialises the
  blocks in reverse order, detected with autograd's current graph task, and prefetches in that direction.
  A slot's "free" event is recorded when the slot is *reclaimed*, so it also covers a block's backward kernels.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .arena import ALIGN, HostArena, module_bytes, swappable_tensors
from .backend import Backend, make_backend
from .config import BlockSwapConfig, default_reserve_bytes, plan_blockswap, spread_indices
from .pool import PinnedPool, get_pinned_pool, new_owner
from .resident import ResidentRunner

_log = logging.getLogger(__name__)
GiB = 1 << 30


class _Slot:
    def __init__(self, index: int, buf: torch.Tensor, backend: Backend):
        self.index = index
        self.buf = buf
        self.unit: Optional["_Unit"] = None
        self.ready = backend.new_event()
        self.free = backend.new_event()
        self.free_recorded = False
        self.dirty = False            # used by compute since the last free-event record
        self.compute_stream = None
        self.last_release = -1


class _Unit:
    def __init__(self, pos: int, name: str, module: nn.Module, kind: str, arena: HostArena):
        self.pos = pos
        self.name = name
        self.module = module
        self.kind = kind              # "block" or "io"
        self.arena = arena
        self.slot: Optional[_Slot] = None
        self.bound = False
        self.uses = 0
        self.views: dict[int, list] = {}
        self.used_bytes = max((r.offset + r.nbytes for r in arena.records), default=0)
        # modules caching tensors derived from their weights (NVFP4Linear: e.g. an fp8 copy on the GPU) say so with
        # a drop_derived() method: a swapped block must not keep them, or it would leave a GPU copy behind
        self.derived = [m for m in module.modules() if callable(getattr(m, "drop_derived", None))]

    def drop_derived(self):
        for m in self.derived:
            m.drop_derived()

    def __repr__(self):
        return f"_Unit({self.name})"


@dataclass
class _Counters:
    passes: int = 0
    copies: int = 0
    bytes_copied: int = 0
    pinned_copies: int = 0
    pageable_copies: int = 0
    prefetched: int = 0            # copies issued ahead of use
    demand_loads: int = 0          # copies issued at use (the compute waits for the whole copy)
    slot_hits: int = 0             # acquired while already in a slot (prefetched or kept)
    timings: list = field(default_factory=list)


def _finalize(backend, pool, owner):
    """The runner was garbage-collected without `close()` (model released): unpin its arenas."""
    try:
        backend.synchronize()
    except Exception:  # noqa: BLE001
        pass
    try:
        pool.release_owner(owner)
    except Exception as exc:  # noqa: BLE001  (e.g. at interpreter exit, CUDA already shut down)
        _log.debug("BlockSwap release at finalisation failed: %s", exc)


class BlockSwapRunner:
    """Block runner for a model whose swapped blocks' tensors live in pinned host arenas."""

    def __init__(self, units: list[tuple[str, nn.Module, str]], config: BlockSwapConfig, backend: Backend,
                 pool: PinnedPool, swapped_indices=(), num_blocks: int = 0, exclude=frozenset(),
                 arenas: Optional[dict] = None, owner: Optional[int] = None):
        """``arenas`` (unit name -> HostArena) and ``owner``: the host copies of a ``StagedModel``, which keeps them
        (and their pins in the pool under ``owner``) after this runner closes; otherwise the runner packs its own
        arenas and unpins them when it closes."""
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.pool = pool
        self.owns_arenas = arenas is None
        self.owner = new_owner() if owner is None else owner
        self.swapped_indices = list(swapped_indices)
        self.num_blocks = num_blocks
        self.closed = False
        self.c = _Counters()
        self._tick = 0
        self._dir = 1
        self._hooks = []
        self.copy_stream = backend.new_stream()
        if self.owns_arenas:
            pool.set_owner_cap(self.owner, config.pinned_cap_bytes)
            self._finalizer = weakref.finalize(self, _finalize, backend, pool, self.owner)
        else:
            self._finalizer = weakref.finalize(self, backend.synchronize)
        sync = self._make_sync()
        self.units: list[_Unit] = []
        try:
            for pos, (name, module, kind) in enumerate(units):
                key = name
                if arenas is not None:
                    arena = arenas[name]
                else:
                    arena = HostArena(module, name,
                                      pin_fn=lambda buf, key=key: pool.add(self.owner, key, buf, backend, sync=sync),
                                      small_bytes=config.small_tensor_bytes, exclude=exclude)
                self.units.append(_Unit(pos, name, module, kind, arena))
            self._by_module = {id(u.module): u for u in self.units}
            slot_bytes = max((u.used_bytes for u in self.units), default=0)
            self.slot_bytes = (slot_bytes + ALIGN - 1) // ALIGN * ALIGN
            n_slots = config.buffers if self.units else 0
            self.slots = [_Slot(i, backend.alloc(self.slot_bytes), backend) for i in range(n_slots)]
            for u in self.units:
                self._hooks.append(u.module.register_forward_pre_hook(self._pre_hook(u)))
                self._hooks.append(u.module.register_forward_hook(self._post_hook(u), always_call=True))
        except BaseException:
            self.close()
            raise

    def _make_sync(self):
        backend, stream = self.backend, self.copy_stream
        return lambda: backend.synchronize(stream)

    # ------------------------------------------------------------------ public API
    @property
    def ring_bytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    @property
    def swapped_bytes(self) -> int:
        return sum(u.used_bytes for u in self.units)

    def iterate(self, blocks, reverse: bool = False):
        """Yield each block of `blocks` in order (last to first with `reverse`), swapped ones materialised.

        Exception-safe: if the caller's loop raises (or is cancelled) the block in use is released; the ring
        stays consistent and `close()` afterwards releases everything.
        """
        self._check_open()
        self._reset_uses()
        d = -1 if reverse else 1
        seq = range(len(blocks) - 1, -1, -1) if reverse else range(len(blocks))
        self.c.passes += 1
        first = next((self._by_module.get(id(blocks[i])) for i in seq if id(blocks[i]) in self._by_module), None)
        if first is not None:
            self._dir = d
            self._prefetch_after(first.pos - d, d, wrap=False)
        current = None
        try:
            for i in seq:
                blk = blocks[i]
                unit = self._by_module.get(id(blk))
                if unit is None:
                    yield blk
                    continue
                self._acquire(unit, d)
                current = unit
                yield blk
                current = None
                self._release(unit)
        finally:
            if current is not None:
                self._release(current)

    def close(self, restore_device=None) -> None:
        """Release everything: wait for in-flight copies, unpin every arena, free the ring, remove the hooks.

        The swapped tensors then point at their (pageable) host arena (also for restore_device="cpu": no copy),
        or at fresh tensors on a GPU `restore_device`.
        Safe to call twice, after an exception, or from `detach`.
        """
        if self.closed:
            return
        self.closed = True
        try:
            self.backend.synchronize()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            for u in getattr(self, "units", []):
                if u.bound:
                    u.arena.unbind()
                    u.bound = False
                u.drop_derived()
                u.slot = None
                u.views = {}
            self.slots = []
            try:
                if restore_device is not None:   # while still pinned: fast copies
                    dev = torch.device(restore_device)
                    for u in getattr(self, "units", []):
                        u.arena.restore_to(dev)
            finally:
                if self.owns_arenas:
                    self.pool.release_owner(self.owner)
                self._finalizer.detach()

    def stats(self) -> dict:
        c = self.c
        return {
            "runner": "blockswap", "swapped_indices": self.swapped_indices,
            "units": [u.name for u in self.units], "buffers": len(self.slots), "prefetch": self.config.prefetch,
            "slot_bytes": self.slot_bytes, "ring_bytes": self.ring_bytes, "swapped_bytes": self.swapped_bytes,
            "pinned_bytes": self.pool.owner_pinned_bytes(self.owner),
            "passes": c.passes, "copies": c.copies, "bytes_copied": c.bytes_copied,
            "pinned_copies": c.pinned_copies, "pageable_copies": c.pageable_copies,
            "prefetched": c.prefetched, "demand_loads": c.demand_loads, "slot_hits": c.slot_hits,
            "pool": self.pool.stats(),
        }

    def reset_stats(self) -> None:
        self.c = _Counters(passes=0)

    def copy_timings(self) -> list[tuple[str, int, float]]:
        """(unit, bytes, ms) per copy since the last reset (needs config.debug_timing). Synchronises."""
        self.backend.synchronize(self.copy_stream)
        return [(name, n, self.backend.elapsed_ms(s, e)) for name, n, s, e in self.c.timings]

    def __repr__(self):
        return (f"BlockSwapRunner({len(self.units)} units, buffers={len(self.slots)}, "
                f"prefetch={self.config.prefetch}, slot={self.slot_bytes / 2**20:.1f} MiB)")

    # ------------------------------------------------------------------ hooks (safety net + training)
    def _pre_hook(self, unit):
        def hook(module, args):
            if self.closed:
                return None
            d = -1 if self.backend.in_backward() else 1
            self._acquire(unit, d)
            return None
        return hook

    def _post_hook(self, unit):
        def hook(module, args, output):
            if self.closed or unit.uses == 0:
                return None
            self._release(unit)
            return None
        return hook

    # ------------------------------------------------------------------ scheduling core
    def _check_open(self):
        if self.closed:
            raise RuntimeError("BlockSwapRunner is closed (detached)")

    def _reset_uses(self):
        for u in self.units:
            if u.uses:
                u.uses = 0
                if u.slot is not None:
                    u.slot.last_release = self._next_tick()

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _wrap_ok(self, d: int) -> bool:
        # inference only: while grad is enabled a backward (reverse order) may follow, which needs the last blocks
        return d > 0 and not torch.is_grad_enabled()

    def _upcoming(self, pos: int, d: int, wrap: bool) -> list[_Unit]:
        m = len(self.units)
        out = []
        for k in range(1, self.config.prefetch + 1):
            p = pos + d * k
            if 0 <= p < m:
                out.append(self.units[p])
            elif wrap and m:
                u = self.units[p % m]
                if u not in out:
                    out.append(u)
            else:
                break
        return out

    def _acquire(self, unit: _Unit, d: int) -> None:
        self._check_open()
        if unit.uses > 0:             # nested (hook inside iterate): already materialised, direction from iterate
            unit.uses += 1
            return
        self._dir = d
        if unit.slot is None:
            self.c.demand_loads += 1
            if not self._load(unit, protected={unit}):
                raise RuntimeError(f"BlockSwap: no free ring slot for {unit.name} "
                                   f"({len(self.slots)} buffers, all in use)")
        else:
            self.c.slot_hits += 1
        slot = unit.slot
        cs = self.backend.current_stream()
        self.backend.wait(cs, slot.ready)
        slot.compute_stream = cs
        slot.dirty = True
        if not unit.bound:
            views = unit.views.get(slot.index)
            if views is None:
                views = unit.views[slot.index] = unit.arena.device_views(slot.buf)
            unit.arena.bind(views)
            unit.bound = True
        unit.uses = 1
        self._prefetch_after(unit.pos, d, wrap=self._wrap_ok(d))

    def _release(self, unit: _Unit) -> None:
        if unit.uses <= 0:
            return
        unit.uses -= 1
        if unit.uses == 0 and unit.slot is not None:
            unit.slot.last_release = self._next_tick()

    def _prefetch_after(self, pos: int, d: int, wrap: bool) -> None:
        upcoming = self._upcoming(pos, d, wrap)
        protected = {u for u in self.units if u.uses > 0} | set(upcoming)
        for u in upcoming:
            if u.slot is not None:
                continue
            if not self._load(u, protected):
                break
            self.c.prefetched += 1

    def _pick_victim(self, protected) -> Optional[_Slot]:
        best = None
        for s in self.slots:
            if s.unit is None:
                return s
            if s.unit.uses > 0 or s.unit in protected:
                continue
            if best is None or s.last_release < best.last_release:
                best = s
        return best

    def _load(self, unit: _Unit, protected) -> bool:
        slot = self._pick_victim(protected)
        if slot is None:
            return False
        be = self.backend
        old = slot.unit
        if old is not None:
            if slot.dirty:            # end of everything the compute stream enqueued on the old block
                be.record(slot.free, slot.compute_stream)
                slot.free_recorded = True
                slot.dirty = False
            if old.bound:
                old.arena.unbind()    # back to the host arena: no copy back
                old.bound = False
            old.drop_derived()
            old.slot = None
            slot.unit = None
        if slot.free_recorded:
            be.wait(self.copy_stream, slot.free)
        n = unit.used_bytes
        pinned = self.pool.touch(self.owner, unit.name)
        timing = self.config.debug_timing
        if timing:
            t0 = be.new_event(timing=True)
            be.record(t0, self.copy_stream)
        be.copy_async(slot.buf[:n], unit.arena.buffer[:n], self.copy_stream, tag=(unit.name, slot.index))
        if timing:
            t1 = be.new_event(timing=True)
            be.record(t1, self.copy_stream)
            self.c.timings.append((unit.name, n, t0, t1))
        be.record(slot.ready, self.copy_stream)
        slot.unit = unit
        unit.slot = slot
        self.c.copies += 1
        self.c.bytes_copied += n
        if pinned:
            self.c.pinned_copies += 1
        else:
            self.c.pageable_copies += 1
        return True


# ---------------------------------------------------------------------------------------------- attach / detach

def _tensors_on(model: nn.Module, device: torch.device) -> int:
    if device.type == "cpu":          # FakeBackend: the host is not VRAM
        return 0
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and t.device == device:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _move_rest(model: nn.Module, keep: set, device: torch.device) -> None:
    with torch.no_grad():
        for mod in model.modules():
            for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
                if t is not None and id(t) not in keep and t.device != device:
                    t.data = t.data.to(device)


def _normalize_device(device, backend):
    if backend is not None:
        return backend.device
    device = torch.device(device if device is not None else "cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def attach_blockswap(model: nn.Module, config: Optional[BlockSwapConfig] = None, device=None, *,
                     backend: Optional[Backend] = None, pool: Optional[PinnedPool] = None,
                     blocks_attr: str = "blocks"):
    """Put `model`'s swapped blocks in pinned host RAM, everything else on `device`; set `model.block_runner`.

    Returns the runner (`ResidentRunner` when nothing needs swapping under blocks_to_swap="auto").
    """
    config = config or BlockSwapConfig()
    device = _normalize_device(device, backend)
    old = getattr(model, "block_runner", None)
    if isinstance(old, BlockSwapRunner) and not old.closed:
        old.close()
    backend = backend or make_backend(device)
    pool = pool or get_pinned_pool(device)
    blocks = getattr(model, blocks_attr)
    n = len(blocks)
    small = config.small_tensor_bytes
    block_bytes = [module_bytes(b, only_swappable=True, small_bytes=small) for b in blocks]
    block_ids = {id(b) for b in blocks}
    io_children = [(name, m) for name, m in model.named_children()
                   if m is not blocks and id(m) not in block_ids
                   and module_bytes(m, only_swappable=True, small_bytes=small) > 0]
    io_total = sum(module_bytes(m, only_swappable=True, small_bytes=small) for _, m in io_children)
    other_bytes = module_bytes(model) - sum(block_bytes)
    swap_io = bool(config.swap_io_components)

    if config.is_auto:
        free, total = backend.mem_get_info()
        available = free + _tensors_on(model, device)
        reserve = config.reserve_bytes if config.reserve_bytes is not None else default_reserve_bytes(total)
        plan = plan_blockswap(block_bytes, other_bytes - (io_total if swap_io else 0), available, reserve,
                              buffers=config.buffers)
        _log.info("[SeedVR2-BW] %s", plan.summary())
        if not plan.fits:
            _log.warning("[SeedVR2-BW] %s", plan.reason)
        swapped = plan.swapped_indices
    else:
        swapped = spread_indices(n, int(config.blocks_to_swap))

    if not swapped and not swap_io:
        _move_rest(model, set(), device)
        runner = ResidentRunner()
        model.block_runner = runner
        return runner

    swapped_set = set(swapped)
    units = []
    for name, child in model.named_children():
        if child is blocks:
            units += [(f"{blocks_attr}.{i}", blocks[i], "block") for i in range(n) if i in swapped_set]
        elif swap_io and any(child is m for _, m in io_children):
            units.append((name, child, "io"))
    counts: dict[int, int] = {}
    for _, m, _ in units:
        for _, t in swappable_tensors(m, small):
            counts[id(t)] = counts.get(id(t), 0) + 1
    shared = frozenset(k for k, c in counts.items() if c > 1)   # tied across swapped units: keep resident
    keep = set(counts) - shared
    _move_rest(model, keep, device)          # resident blocks, I/O, trainable and tied tensors: on the GPU
    runner = BlockSwapRunner(units, config, backend, pool, swapped_indices=swapped, num_blocks=n, exclude=shared)
    if backend.device.type == "cuda":
        torch.cuda.empty_cache()                  # the swapped blocks' former GPU storage
    model.block_runner = runner
    st = runner.stats()
    _log.info("[SeedVR2-BW] BlockSwap: %d of %d blocks swapped %s%s, %.2f GiB in host RAM (%.2f GiB pinned), "
              "ring %d x %.0f MiB, prefetch %d", len(swapped), n, swapped, " + I/O" if swap_io else "",
              st["swapped_bytes"] / GiB, st["pinned_bytes"] / GiB, len(runner.slots), runner.slot_bytes / 2**20,
              config.prefetch)
    return runner


def detach(model_or_runner, restore_device=None) -> dict:
    """Release the runner of a model (or a runner): pinned memory, ring buffers, hooks. Returns its last stats.

    `restore_device`: a GPU moves the swapped blocks back there; None or "cpu" leaves them in their (now
    pageable) host arenas, without a copy.
    """
    runner = getattr(model_or_runner, "block_runner", model_or_runner)
    stats = runner.stats() if hasattr(runner, "stats") else {}
    if hasattr(runner, "close"):
        runner.close(restore_device=restore_device)
    if hasattr(model_or_runner, "block_runner"):
        model_or_runner.block_runner = ResidentRunner()
    return stats
