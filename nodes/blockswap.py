"""BlockSwap node (ComfyUI V3 API): outputs a BlockSwapConfig for the DiT loader.

The loader attaches it when the DiT is loaded: the swapped blocks then live in pinned host RAM and stream through
a ring of GPU buffers on a copy stream, overlapped with the compute of the other blocks.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..optimization.blockswap import BlockSwapConfig as BlockSwapSettings
from .types import CATEGORY, BlockSwapConfig

GiB = 1 << 30


def make_config(blocks_to_swap: int, prefetch: int, buffers: int, swap_io_components: bool,
                pinned_cap_gb: float, reserve_gb: float) -> BlockSwapSettings:
    """Node inputs -> BlockSwapConfig. -1 blocks = auto; 0 GB cap/reserve = the defaults."""
    return BlockSwapSettings(
        blocks_to_swap="auto" if blocks_to_swap < 0 else int(blocks_to_swap),
        prefetch=int(prefetch),
        buffers=max(int(buffers), int(prefetch) + 1),
        swap_io_components=bool(swap_io_components),
        pinned_cap_bytes=int(pinned_cap_gb * GiB) if pinned_cap_gb > 0 else None,
        reserve_bytes=int(reserve_gb * GiB) if reserve_gb > 0 else None,
    )


class BlockSwap(io.ComfyNode):
    """Streams part of the DiT's transformer blocks from system RAM (for 8-24 GB cards)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SeedVR2BW_BlockSwap",
            display_name="SeedVR2 BlockSwap (SeedVR2-BW)",
            category=CATEGORY,
            description="Keeps some DiT blocks in pinned system RAM and streams them to the GPU ahead of use on a "
                        "copy stream (spread evenly over the depth, in their stored dtype: fp8/NVFP4 move 2-3.5x "
                        "fewer bytes). Connect to the DiT loader's 'blockswap' input.",
            inputs=[
                io.Int.Input("blocks_to_swap", default=-1, min=-1, max=64,
                             tooltip="Blocks kept in system RAM (7B: 36 blocks, 3B: 32). -1 = auto: the run's memory "
                                     "plan streams as few as the VRAM this run may use allows (logged)."),
                io.Int.Input("prefetch", default=1, min=1, max=4,
                             tooltip="Swapped blocks copied ahead of the one computing. 1 is enough when a "
                                     "block's compute takes longer than its copy."),
                io.Int.Input("buffers", default=2, min=2, max=6,
                             tooltip="GPU ring buffers, each the size of one block (raised to prefetch+1)."),
                io.Boolean.Input("swap_io_components", default=False,
                                 tooltip="Also stream the embeddings and patch in/out layers (saves ~0.2 GB). The "
                                         "SeedVR2 upscaler's memory plan keeps them on the GPU."),
                io.Float.Input("pinned_cap_gb", default=0.0, min=0.0, max=1024.0, step=0.5,
                               tooltip="Cap on pinned (page-locked) RAM for this model. 0 = the pack's pinned "
                                       "pool (Windows 40 % of RAM, WSL 1 GB, Linux half of RAM but at least 8 GB "
                                       "left free; SEEDVR2BW_PINNED_POOL_BYTES). Blocks beyond the cap are copied "
                                       "from pageable memory (slower)."),
                io.Float.Input("reserve_gb", default=0.0, min=0.0, max=64.0, step=0.25,
                               tooltip="VRAM kept for the DiT's activations when blocks_to_swap = -1, at least. "
                                       "0 = the memory plan's estimate for the chunk size (logged)."),
            ],
            outputs=[BlockSwapConfig.Output(display_name="blockswap")],
        )

    @classmethod
    def execute(cls, blocks_to_swap: int, prefetch: int, buffers: int, swap_io_components: bool,
                pinned_cap_gb: float, reserve_gb: float) -> io.NodeOutput:
        return io.NodeOutput(make_config(blocks_to_swap, prefetch, buffers, swap_io_components, pinned_cap_gb,
                                         reserve_gb))


NODES = [BlockSwap]
