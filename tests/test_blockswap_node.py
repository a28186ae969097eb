"""BlockSwap node: schema and config output (needs a ComfyUI tree for comfy_api; skipped otherwise)."""
import pytest
from comfy_env import import_node_module


@pytest.fixture
def node_module():
    return import_node_module("blockswap")


def test_schema_and_execute(node_module):
    from seedvr2bw.optimization.blockswap import BlockSwapConfig
    mod = node_module
    assert mod.NODES == [mod.BlockSwap]
    schema = mod.BlockSwap.define_schema()
    assert schema.node_id == "SeedVR2BW_BlockSwap"
    out = mod.BlockSwap.execute(blocks_to_swap=-1, prefetch=2, buffers=2, swap_io_components=True,
                                pinned_cap_gb=4.0, reserve_gb=0.0)
    cfg = out.args[0] if hasattr(out, "args") else out.result[0]
    assert isinstance(cfg, BlockSwapConfig)
    assert cfg.blocks_to_swap == "auto" and cfg.prefetch == 2 and cfg.buffers == 3 and cfg.swap_io_components
    assert cfg.pinned_cap_bytes == 4 << 30 and cfg.reserve_bytes is None
    cfg = mod.make_config(12, 1, 2, False, 0.0, 3.0)
    assert cfg.blocks_to_swap == 12 and cfg.pinned_cap_bytes is None and cfg.reserve_bytes == 3 << 30
