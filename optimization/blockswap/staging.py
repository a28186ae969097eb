"""A model whose host copy is packed once into pinned arenas and staged on a GPU phase by phase.

Why: re-pinning the swapped blocks on every run and copying the resident ones back into fresh pageable memory after
it cost seconds per run on a consumer budget (docs/PERFORMANCE.md §10). Here the host arenas are the model's only
host copy, pinned once (within the pool's cap; the rest stays pageable) and kept across runs:

* ``to_device(device, swapped)``: resident units get one GPU buffer each, filled by one copy from their arena; the
  swapped ones stream through a ``BlockSwapRunner`` over the same arenas; small tensors are copied over.
* ``release()``: every tensor points at its host arena again (the weights never change, so nothing is copied back),
  the GPU buffers and the tensors derived from the weights (an NVFP4 layer's FP8 copy) are dropped.
* ``close()`` (or garbage collection of the model's stager) unpins the arenas.

Units are the blocks and the other children holding streamable tensors (embeddings, input/output layers); tensors
under the small-tensor size stay outside the arenas and are copied on each ``to_device`` (kilobytes).
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional, Sequence

import torch
from torch import nn

from .arena import ALIGN, SMALL_TENSOR_BYTES, HostArena, swappable_tensors
from .backend import Backend, make_backend
from .config import BlockSwapConfig
from .pool import PinnedPool, get_pinned_pool, new_owner
from .resident import ResidentRunner
from .runner import BlockSwapRunner

_log = logging.getLogger(__name__)
GiB = 1 << 30


def _release_pins(pool: PinnedPool, owner: int) -> None:
    try:
        pool.release_owner(owner)
    except Exception as exc:  # noqa: BLE001  (interpreter exit: CUDA may be gone)
        _log.debug("staged model: unpinning at finalisation failed: %s", exc)


class StagedModel:
    """``model`` (on the CPU) with its blocks in ``model.<blocks_attr>`` (None: no blocks, its children are the
    units, e.g. the VAE's encoder and decoder); see the module docstring."""

    def __init__(self, model: nn.Module, blocks_attr: Optional[str] = "blocks", pool: Optional[PinnedPool] = None,
                 small_bytes: int = SMALL_TENSOR_BYTES):
        self.model = model
        self.blocks_attr = blocks_attr
        self.small_bytes = small_bytes
        self._pool = pool
        self.owner = new_owner()
        blocks = getattr(model, blocks_attr) if blocks_attr else []
        block_ids = {id(b) for b in blocks}
        self.block_names = [f"{blocks_attr}.{i}" for i in range(len(blocks))]
        units = list(zip(self.block_names, blocks))
        units += [(name, m) for name, m in model.named_children()
                  if m is not blocks and id(m) not in block_ids and swappable_tensors(m, small_bytes)]
        with torch.no_grad():
            self.units = {name: (m, HostArena(m, name, small_bytes=small_bytes)) for name, m in units}
        packed = {id(r.tensor) for _, a in self.units.values() for r in a.records}
        seen, self.rest = set(), []
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in packed and id(t) not in seen:
                seen.add(id(t))
                self.rest.append((t, t.data))
        self.device: Optional[torch.device] = None
        self.runner = None
        self._buffers: list[torch.Tensor] = []
        self._pinned_for: set = set()
        self._finalizer = None

    # ------------------------------------------------------------------ facts
    @property
    def pool(self) -> PinnedPool:
        if self._pool is None:
            self._pool = get_pinned_pool(self.device)
        return self._pool

    def unit_bytes(self, name: str) -> int:
        """Bytes of one unit's arena payload (what one copy moves, in the stored formats)."""
        arena = self.units[name][1]
        return max((r.offset + r.nbytes for r in arena.records), default=0)

    @property
    def block_bytes(self) -> list[int]:
        return [self.unit_bytes(n) for n in self.block_names]

    @property
    def other_bytes(self) -> int:
        """Bytes always on the GPU during a phase: the non-block units and the small tensors."""
        io = sum(self.unit_bytes(n) for n in self.units if n not in self.block_names)
        return io + sum(d.numel() * d.element_size() for _, d in self.rest)

    def pinned_bytes(self) -> int:
        return self.pool.owner_pinned_bytes(self.owner) if self._pool is not None else 0

    # ------------------------------------------------------------------ staging
    def pin(self, device, backend: Optional[Backend] = None, cap: Optional[int] = None) -> int:
        """Pin the host arenas now (e.g. when the model is loaded) instead of at the first ``to_device``; returns
        the bytes pinned (the pool's cap, and ``cap`` for this model, may leave some pageable)."""
        backend = backend or make_backend(device)
        self.device = backend.device
        self.pool.set_owner_cap(self.owner, cap)
        self._pin(backend, ())
        return self.pinned_bytes()

    def _pin(self, backend: Backend, first: Sequence[str]) -> None:
        """Register every arena with the pool once (``first`` -- the swapped units -- before the others, so a cap
        leaves the once-per-run resident copies pageable rather than the every-pass swapped ones)."""
        pool = self.pool
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, _release_pins, pool, self.owner)
        order = list(first) + [n for n in self.units if n not in first]
        for name in order:
            if name in self._pinned_for:
                pool.touch(self.owner, name)
                continue
            pool.add(self.owner, name, self.units[name][1].buffer, backend, sync=lambda: backend.synchronize())
            self._pinned_for.add(name)

    def to_device(self, device, swapped: Sequence[int] = (), config: Optional[BlockSwapConfig] = None,
                  backend: Optional[Backend] = None):
        """Put the model on ``device`` with the blocks at indices ``swapped`` streamed (BlockSwap) and the rest
        resident; returns the block runner it sets on the model."""
        if self.runner is not None or self._buffers:
            self.release()
        backend = backend or make_backend(device)
        self.device = backend.device
        config = config or BlockSwapConfig(blocks_to_swap=len(swapped))
        swapped_names = [self.block_names[i] for i in sorted(set(swapped))]
        if not self._pinned_for:
            self.pool.set_owner_cap(self.owner, config.pinned_cap_bytes)
        self._pin(backend, swapped_names)
        stream = backend.current_stream()
        with torch.no_grad():
            for name, (module, arena) in self.units.items():
                if name in swapped_names:
                    continue
                n = self.unit_bytes(name)
                buf = backend.alloc((n + ALIGN - 1) // ALIGN * ALIGN)
                backend.copy_async(buf[:n], arena.buffer[:n], stream, tag=(name, "resident"))
                arena.bind(arena.device_views(buf))
                self._buffers.append(buf)
            for t, host in self.rest:
                t.data = host.to(self.device, non_blocking=True)
        if swapped_names:
            units = [(name, self.units[name][0], "block") for name in swapped_names]
            self.runner = BlockSwapRunner(units, config, backend, self.pool, swapped_indices=sorted(set(swapped)),
                                          num_blocks=len(self.block_names),
                                          arenas={n: self.units[n][1] for n in swapped_names}, owner=self.owner)
        else:
            self.runner = ResidentRunner()
        if self.blocks_attr:
            self.model.block_runner = self.runner
        return self.runner

    def release(self) -> None:
        """Back to the host arenas: no copy, the GPU storage and derived tensors dropped."""
        runner, self.runner = self.runner, None
        if isinstance(runner, BlockSwapRunner):
            runner.close()
        with torch.no_grad():
            for name, (module, arena) in self.units.items():
                arena.unbind()
                for m in module.modules():
                    if callable(getattr(m, "drop_derived", None)):
                        m.drop_derived()
            for t, host in self.rest:
                t.data = host
        self._buffers = []
        if self.blocks_attr:
            self.model.block_runner = ResidentRunner()

    def close(self) -> None:
        """Release and unpin; the model stays usable on the CPU (pageable arenas)."""
        self.release()
        if self._finalizer is not None:
            self._finalizer()
        self._pinned_for.clear()

    def __repr__(self):
        return (f"StagedModel({len(self.units)} units, {sum(self.block_bytes) / GiB:.2f} GiB blocks, "
                f"{self.pinned_bytes() / GiB:.2f} GiB pinned, on {self.device if self.runner else 'host'})")
