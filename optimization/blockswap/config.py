"""BlockSwap configuration and planning (pure Python: no CUDA needed).

`BlockSwapConfig` is what the BlockSwap node outputs and `attach_blockswap` takes.
`plan_blockswap` decides whether swapping is needed and how many blocks, from sizes and free VRAM.
`spread_indices` picks which blocks: spread evenly across the depth (measured: interleaving swapped blocks
among resident ones costs +4.6 % where swapping the first/last N contiguously costs +53-70 %, docs/PERFORMANCE.md §8).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

GiB = 1 << 30
DEFAULT_RESERVE_BYTES = 2 * GiB


@dataclass
class BlockSwapConfig:
    """How to stream transformer blocks between host RAM and the GPU.

    blocks_to_swap: number of blocks kept in host RAM, or "auto" (computed from free VRAM minus `reserve_bytes`).
    prefetch: how many swapped blocks ahead are copied while the current one computes (needs buffers > prefetch).
    buffers: GPU ring slots, each the size of the largest swapped block (default 2 = double buffering).
    swap_io_components: also stream the non-block components (embeddings, patch in/out).
    pinned_cap_bytes: hard cap on pinned host bytes for this model (None: the platform default / hardware policy).
    reserve_bytes: VRAM left free for activations when blocks_to_swap="auto" (None: max(2 GiB, 10 % of VRAM)).
    """

    blocks_to_swap: Union[int, str] = "auto"
    prefetch: int = 1
    buffers: int = 2
    swap_io_components: bool = False
    pinned_cap_bytes: Optional[int] = None
    reserve_bytes: Optional[int] = None
    debug_timing: bool = False  # per-copy CUDA events (bench / diagnostics); off on the hot path by default
    small_tensor_bytes: int = 16384  # tensors smaller than this stay on the GPU (norms, RoPE freqs, scales)

    def __post_init__(self):
        if isinstance(self.blocks_to_swap, str):
            if self.blocks_to_swap != "auto":
                raise ValueError(f"blocks_to_swap must be an int >= 0 or 'auto', got {self.blocks_to_swap!r}")
        elif int(self.blocks_to_swap) < 0:
            raise ValueError(f"blocks_to_swap must be >= 0, got {self.blocks_to_swap}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.buffers < 2:
            raise ValueError(f"buffers must be >= 2, got {self.buffers}")
        if self.buffers < self.prefetch + 1:
            raise ValueError(f"buffers ({self.buffers}) must be >= prefetch + 1 ({self.prefetch + 1}): "
                             "one slot computes while `prefetch` slots fill")
        if self.pinned_cap_bytes is not None and self.pinned_cap_bytes < 0:
            raise ValueError("pinned_cap_bytes must be >= 0 or None")
        if self.reserve_bytes is not None and self.reserve_bytes < 0:
            raise ValueError("reserve_bytes must be >= 0 or None")

    @property
    def is_auto(self) -> bool:
        return isinstance(self.blocks_to_swap, str)


def spread_indices(num_blocks: int, num_swapped: int) -> list[int]:
    """`num_swapped` block indices spread evenly over `num_blocks` (centred in equal strides).

    9 of 36 -> [2, 6, 10, ..., 34]; n of n -> all; 0 -> [].
    """
    if num_swapped <= 0 or num_blocks <= 0:
        return []
    num_swapped = min(num_swapped, num_blocks)
    return [int((k + 0.5) * num_blocks / num_swapped) for k in range(num_swapped)]


def default_reserve_bytes(total_vram: Optional[int]) -> int:
    if not total_vram:
        return DEFAULT_RESERVE_BYTES
    return max(DEFAULT_RESERVE_BYTES, int(0.10 * total_vram))


@dataclass
class BlockSwapPlan:
    enabled: bool
    blocks_to_swap: int
    swapped_indices: list[int]
    gpu_bytes: int          # weights kept on the GPU + the ring buffers
    ring_bytes: int         # buffers x largest swapped block
    budget_bytes: int       # free_vram - reserve
    fits: bool
    reason: str
    swapped_bytes: int = 0
    swap_io_components: bool = False
    details: dict = field(default_factory=dict)

    def summary(self) -> str:
        if not self.enabled:
            return f"BlockSwap off: {self.reason}"
        return (f"BlockSwap {self.blocks_to_swap} blocks {self.swapped_indices} "
                f"({self.swapped_bytes / GiB:.2f} GiB in host RAM, ring {self.ring_bytes / GiB:.2f} GiB, "
                f"GPU {self.gpu_bytes / GiB:.2f} of {self.budget_bytes / GiB:.2f} GiB budget): {self.reason}")


def gpu_bytes(block_bytes: Sequence[int], other_bytes: int, swapped: Sequence[int], buffers: int = 2,
              block_extra: Optional[Sequence[int]] = None, io_bytes: Sequence[int] = ()) -> tuple[int, int]:
    """(bytes on the GPU, of which ring slots) with the blocks at ``swapped`` streamed: the resident blocks and what
    they derive (``block_extra``), ``other_bytes`` unless the I/O components (``io_bytes``) stream too, and ``buffers``
    slots of the largest streamed unit plus its derived bytes."""
    extra = list(block_extra) if block_extra is not None else [0] * len(block_bytes)
    s = set(swapped)
    largest = max([block_bytes[i] for i in s] + list(io_bytes), default=0)
    resident = sum(b + extra[i] for i, b in enumerate(block_bytes) if i not in s)
    ring = buffers * (largest + max((extra[i] for i in s), default=0)) if (s or io_bytes) else 0
    return resident + (0 if io_bytes else int(other_bytes)) + ring, ring


def plan_blockswap(block_bytes: Sequence[int], other_bytes: int, free_vram: int, reserve: int,
                   buffers: int = 2, io_bytes: Optional[Sequence[int]] = None,
                   allow_io_swap: bool = False, block_extra: Optional[Sequence[int]] = None) -> BlockSwapPlan:
    """Decide automatic BlockSwap enablement and the number of swapped blocks.

    block_bytes: bytes of each block in its stored dtype; other_bytes: the non-block weights (embeddings, I/O);
    free_vram: bytes the model may use on the GPU (free memory + what this model already occupies there);
    reserve: bytes to keep free for activations. The swapped blocks are spread evenly (`spread_indices`).
    The GPU then holds: other_bytes + resident blocks + buffers x largest swapped block.
    If even all blocks swapped do not fit and `allow_io_swap`, the non-block components (`io_bytes`, summing to
    other_bytes) are swapped too. The plan says `fits=False` when nothing fits (the caller should refuse or warn).
    `block_extra`: bytes each block derives on the GPU while it is there (e.g. an FP8 copy of NVFP4 weights), counted
    for the resident blocks and for each ring slot.
    """
    n = len(block_bytes)
    extra = list(block_extra) if block_extra is not None else [0] * n
    budget = int(free_vram) - int(reserve)
    total = sum(block_bytes) + sum(extra) + int(other_bytes)
    if total <= budget:
        return BlockSwapPlan(False, 0, [], total, 0, budget, True,
                             f"model fits: {total / GiB:.2f} GiB <= {budget / GiB:.2f} GiB budget")

    def cost(s: int, io_swapped: bool):
        idx = spread_indices(n, s)
        gpu, ring = gpu_bytes(block_bytes, other_bytes, idx, buffers, extra, io_bytes if io_swapped else ())
        return idx, gpu, ring, sum(block_bytes[i] for i in idx)

    for io_swapped in ([False, True] if allow_io_swap and io_bytes else [False]):
        for s in range(1, n + 1):
            idx, gpu, ring, swapped_bytes = cost(s, io_swapped)
            if gpu <= budget:
                return BlockSwapPlan(True, s, idx, gpu, ring, budget, True,
                                     f"model {total / GiB:.2f} GiB > budget {budget / GiB:.2f} GiB"
                                     + ("; I/O components swapped too" if io_swapped else ""),
                                     swapped_bytes=swapped_bytes, swap_io_components=io_swapped)
    io_swapped = bool(allow_io_swap and io_bytes)
    idx, gpu, ring, swapped_bytes = cost(n, io_swapped)
    return BlockSwapPlan(True, n, idx, gpu, ring, budget, False,
                         f"does not fit even with all {n} blocks swapped: needs {gpu / GiB:.2f} GiB on the GPU, "
                         f"budget {budget / GiB:.2f} GiB (use fp8/NVFP4 weights or lower the reserve)",
                         swapped_bytes=swapped_bytes, swap_io_components=io_swapped)
