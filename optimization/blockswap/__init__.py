"""Block runners: resident (default) and BlockSwap (stream blocks from pinned host RAM through a GPU ring).

Model code runs its blocks as ``for block in self.block_runner.iterate(self.blocks): ...``.

Inference::

    runner = attach_blockswap(model, BlockSwapConfig(blocks_to_swap="auto"), device)   # sets model.block_runner
    ...                                    # every forward streams the swapped blocks (prefetch, no host waits)
    detach(model)                          # unpins everything; weights stay in host RAM (restore_device=gpu: back)

Training (frozen base weights, trainable adapters stay resident): run each block under gradient
checkpointing; the forward goes through ``iterate`` (or hooks), and the recomputation in backward re-materialises
the blocks in reverse order through the forward hooks (direction detected from autograd), prefetching backwards::

    for block in model.block_runner.iterate(model.blocks):
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    loss.backward()

``iterate(blocks, reverse=True)`` yields the blocks last to first for a hand-written backward loop. Without
checkpointing, autograd would keep tensors aliasing ring slots that get refilled: each swapped weight's version
counter is bumped when its block leaves the ring, so such a backward raises ("modified by an inplace operation")
instead of silently using another block's weights.
"""
from .config import BlockSwapConfig, BlockSwapPlan, plan_blockswap, spread_indices, default_reserve_bytes
from .resident import ResidentRunner
from .pool import PinnedPool, get_pinned_pool
from .backend import CudaBackend, FakeBackend, make_backend
from .arena import HostArena, module_bytes
from .runner import BlockSwapRunner, attach_blockswap, detach

__all__ = [
    "BlockSwapConfig", "BlockSwapPlan", "plan_blockswap", "spread_indices", "default_reserve_bytes",
    "ResidentRunner", "BlockSwapRunner", "attach_blockswap", "detach",
    "PinnedPool", "get_pinned_pool",
    "CudaBackend", "FakeBackend", "make_backend", "HostArena", "module_bytes",
]
