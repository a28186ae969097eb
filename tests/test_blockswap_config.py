"""BlockSwap planning: which blocks, how many, automatic enablement, config validation (CPU)."""
import pytest

from seedvr2bw.optimization.blockswap import BlockSwapConfig, plan_blockswap, spread_indices
from seedvr2bw.optimization.blockswap.config import default_reserve_bytes

MB = 1 << 20
GB = 1 << 30


def test_spread_even_and_centred():
    assert spread_indices(36, 9) == [2, 6, 10, 14, 18, 22, 26, 30, 34]
    assert spread_indices(36, 36) == list(range(36))
    assert spread_indices(36, 0) == []
    assert spread_indices(36, 50) == list(range(36))
    for n in range(1, 40):
        for s in range(1, n + 1):
            idx = spread_indices(n, s)
            assert len(idx) == len(set(idx)) == s
            assert idx == sorted(idx) and 0 <= idx[0] and idx[-1] < n
            gaps = [b - a for a, b in zip(idx, idx[1:])]
            if gaps:
                assert max(gaps) - min(gaps) <= 1          # evenly spread
    assert spread_indices(32, 2) == [8, 24]


def test_config_validation():
    BlockSwapConfig()
    BlockSwapConfig(blocks_to_swap=12, prefetch=2, buffers=3)
    with pytest.raises(ValueError):
        BlockSwapConfig(blocks_to_swap=-1)
    with pytest.raises(ValueError):
        BlockSwapConfig(blocks_to_swap="most")
    with pytest.raises(ValueError):
        BlockSwapConfig(prefetch=2, buffers=2)       # a slot must stay for the block in use
    with pytest.raises(ValueError):
        BlockSwapConfig(buffers=1)
    with pytest.raises(ValueError):
        BlockSwapConfig(prefetch=0)
    assert BlockSwapConfig().is_auto and not BlockSwapConfig(blocks_to_swap=3).is_auto


def test_plan_fits_no_swap():
    p = plan_blockswap([453 * MB] * 36, 300 * MB, free_vram=40 * GB, reserve=2 * GB)
    assert not p.enabled and p.fits and p.blocks_to_swap == 0 and p.swapped_indices == []


def test_plan_minimal_swap_count():
    blocks = [453 * MB] * 36
    other = 300 * MB
    free, reserve = 16 * GB, 2 * GB
    p = plan_blockswap(blocks, other, free, reserve, buffers=2)
    assert p.enabled and p.fits
    budget = free - reserve
    # the chosen count fits, one fewer does not
    s = p.blocks_to_swap
    assert other + (36 - s) * 453 * MB + 2 * 453 * MB <= budget
    assert other + (36 - s + 1) * 453 * MB + 2 * 453 * MB > budget
    assert p.swapped_indices == spread_indices(36, s)
    assert p.ring_bytes == 2 * 453 * MB
    assert p.gpu_bytes <= p.budget_bytes
    assert "BlockSwap" in p.summary()


def test_plan_does_not_fit():
    p = plan_blockswap([453 * MB] * 36, 3 * GB, free_vram=4 * GB, reserve=2 * GB)
    assert p.enabled and not p.fits and p.blocks_to_swap == 36
    # swapping the I/O components too makes it fit
    p2 = plan_blockswap([453 * MB] * 36, 3 * GB, free_vram=4 * GB, reserve=2 * GB,
                        io_bytes=[GB // 2] * 6, allow_io_swap=True)
    assert p2.fits and p2.swap_io_components


def test_plan_uneven_blocks_uses_largest_swapped_for_ring():
    blocks = [317 * MB] * 10 + [159 * MB] * 22      # 3B: 10 MM blocks then shared ones
    p = plan_blockswap(blocks, 200 * MB, free_vram=5 * GB, reserve=1 * GB)
    assert p.enabled and p.fits
    largest = max(blocks[i] for i in p.swapped_indices)
    assert p.ring_bytes == 2 * largest


def test_default_reserve():
    assert default_reserve_bytes(None) == 2 * GB
    assert default_reserve_bytes(8 * GB) == 2 * GB
    assert default_reserve_bytes(80 * GB) == 8 * GB
