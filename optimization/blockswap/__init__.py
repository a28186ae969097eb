"""Block runners: resident (default) and BlockSwap (stream blocks from pinned host RAM through a GPU ring).

Model code runs its blocks as ``for block in self.block_runner.iterate(self.blocks): ...``.
"""
from .config import BlockSwapConfig, BlockSwapPlan, plan_blockswap, spread_indices, default_reserve_bytes
from .resident import ResidentRunner
from .pool import PinnedPool, get_pinned_pool, platform_pinned_cap
from .backend import CudaBackend, FakeBackend, make_backend
from .arena import HostArena, module_bytes
from .runner import BlockSwapRunner, attach_blockswap, detach

__all__ = [
    "BlockSwapConfig", "BlockSwapPlan", "plan_blockswap", "spread_indices", "default_reserve_bytes",
    "ResidentRunner", "BlockSwapRunner", "attach_blockswap", "detach",
    "PinnedPool", "get_pinned_pool", "platform_pinned_cap",
    "CudaBackend", "FakeBackend", "make_backend", "HostArena", "module_bytes",
]
