"""The ops' shared device tensors live exactly as long as a model of the pack: once the last DiT (or trainer) is
collected, the next call makes them again, so ComfyUI's unload leaves none of them on the GPU."""
import gc

from seedvr2bw.models.seedvr2.dit import SEEDVR2_3B, build_dit
from seedvr2bw.optimization.nvfp4.int8 import hadamard
from seedvr2bw.optimization.runtime import device_cache


def test_shared_tensors_dropped_with_the_last_model():
    gc.collect()
    base = device_cache.leases()
    first, second = build_dit(SEEDVR2_3B, device="meta"), build_dit(SEEDVR2_3B, device="meta")
    assert device_cache.leases() == base + 2
    h = hadamard(16)
    assert hadamard(16) is h                      # cached while a model lives
    del first
    gc.collect()
    assert hadamard(16) is h                      # one model still holds the lease
    if base == 0:
        del second
        gc.collect()
        assert device_cache.leases() == 0
        assert hadamard(16) is not h              # the last model took the cached tensors with it
        assert (hadamard(16) == h).all()


def test_clear_empties_every_cache():
    h = hadamard(64)
    device_cache.clear()
    assert hadamard(64) is not h
