"""BlockSwap on a real GPU: bit-identical output vs resident, no pinned memory left (detach, exception mid-run,
model released), peak extra VRAM bound, pinning fallback with the CUDA error cleared. Skipped without CUDA."""
import copy
import gc

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from seedvr2bw.optimization.blockswap import (BlockSwapConfig, BlockSwapRunner, CudaBackend, PinnedPool,  # noqa: E402
                                               ResidentRunner, attach_blockswap, detach)

DEV = torch.device("cuda")
D = 1024


class Block(nn.Module):
    def __init__(self, d=D, fp8=False):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d)
        self.mlp_in = nn.Linear(d, 4 * d)
        self.mlp_out = nn.Linear(4 * d, d)
        self.register_buffer("ada", torch.randn(6, d) * 0.1)
        self.fp8 = fp8
        if fp8:
            self.w8 = nn.Parameter((torch.randn(d, d) * 0.05).to(torch.float8_e4m3fn), requires_grad=False)
            self.register_buffer("w8_scale", torch.tensor(0.5))

    def forward(self, x):
        a = self.ada.to(x.dtype)
        h = nn.functional.layer_norm(x, x.shape[-1:]) * (1 + a[0]) + a[1]
        q, k, v = self.qkv(h).unflatten(-1, (3, 16, -1)).permute(1, 0, 2, 3).unbind(0)
        o = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.out(o.transpose(0, 1).flatten(1)) * a[2]
        h = nn.functional.layer_norm(x, x.shape[-1:]) * (1 + a[3]) + a[4]
        if self.fp8:
            h = h + h @ (self.w8.to(x.dtype) * self.w8_scale.to(x.dtype)).t()
        return x + self.mlp_out(nn.functional.gelu(self.mlp_in(h))) * a[5]


class Model(nn.Module):
    def __init__(self, n=8, fp8=False):
        super().__init__()
        self.emb = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(fp8=fp8) for _ in range(n)])
        self.head = nn.Linear(D, D)
        self.block_runner = ResidentRunner()

    def forward(self, x):
        x = self.emb(x)
        for b in self.block_runner.iterate(self.blocks):
            x = b(x)
        return self.head(x)


def make(n=8, fp8=False, seed=0):
    torch.manual_seed(seed)
    m = Model(n, fp8).to(torch.bfloat16).requires_grad_(False)
    if fp8:
        for b in m.blocks:
            b.w8.data = b.w8.data.to(torch.float8_e4m3fn)
    ref = copy.deepcopy(m).to(DEV)
    return m.to(DEV), ref


def driver_registered(buf) -> bool:
    """Ask the driver: registering an already registered range fails (cudaErrorHostMemoryAlreadyRegistered)."""
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
    if err == 0:
        cudart.cudaHostUnregister(buf.data_ptr())
        return False
    from seedvr2bw.optimization.blockswap.backend import clear_cuda_error
    clear_cuda_error()
    return err == 712


def pinned(buf) -> bool:
    return CudaBackend(DEV).is_pinned(buf) and driver_registered(buf)


def attach(m, **cfg):
    pool = PinnedPool(64 << 30)
    r = attach_blockswap(m, BlockSwapConfig(**cfg), DEV, pool=pool)
    return r, pool


@pytest.mark.parametrize("n_swap,prefetch,buffers,fp8", [(3, 1, 2, False), (8, 1, 2, False), (8, 2, 3, True),
                                                         (5, 1, 2, True)])
def test_bit_identical_vs_resident(n_swap, prefetch, buffers, fp8):
    m, ref = make(fp8=fp8)
    r, pool = attach(m, blocks_to_swap=n_swap, prefetch=prefetch, buffers=buffers, swap_io_components=n_swap == 8)
    assert isinstance(r, BlockSwapRunner)
    assert all(pinned(u.arena.buffer) for u in r.units)
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(512, D, device=DEV, dtype=torch.bfloat16)
            assert torch.equal(m(x), ref(x))
    st = r.stats()
    assert st["pinned_copies"] == st["copies"] > 0 and st["demand_loads"] <= 1
    units = list(r.units)
    detach(m)
    assert pool.pinned_bytes == 0
    assert not any(driver_registered(u.arena.buffer) for u in units)
    assert CudaBackend.registered_bytes() == 0


def test_no_pinned_left_after_exception_and_detach():
    m, ref = make()
    r, pool = attach(m, blocks_to_swap=6)
    arenas = [u.arena.buffer for u in r.units]
    assert all(pinned(a) for a in arenas)
    with torch.inference_mode():
        x = torch.randn(256, D, device=DEV, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="cancel"):
            for i, b in enumerate(m.block_runner.iterate(m.blocks)):
                if i == 5:
                    raise RuntimeError("cancelled by user")
                x = b(x)
        x = torch.randn(256, D, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(m(x), ref(x))                     # consistent after the cancelled run
    detach(m)
    assert pool.pinned_bytes == 0 and not any(driver_registered(a) for a in arenas)
    assert CudaBackend.registered_bytes() == 0
    with torch.inference_mode():
        for i in r.swapped_indices:                           # swapped weights stay in host RAM, intact
            assert m.blocks[i].qkv.weight.device.type == "cpu"
            assert torch.equal(m.blocks[i].qkv.weight.to(DEV), ref.blocks[i].qkv.weight)


def test_no_pinned_left_after_model_released():
    m, _ = make()
    r, pool = attach(m, blocks_to_swap=8)
    arenas = [u.arena.buffer for u in r.units]
    with torch.inference_mode():
        m(torch.randn(64, D, device=DEV, dtype=torch.bfloat16))
    del m, r
    gc.collect()
    assert pool.pinned_bytes == 0 and not any(driver_registered(a) for a in arenas)
    assert CudaBackend.registered_bytes() == 0


def test_peak_extra_vram_bound():
    n = 8
    m, ref = make(n=n)
    del ref
    torch.cuda.empty_cache()
    x = torch.randn(2048, D, device=DEV, dtype=torch.bfloat16)
    with torch.inference_mode():
        m(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        m(x)
        peak_res = torch.cuda.max_memory_allocated()
    block_bytes = sum(t.numel() * t.element_size() for t in list(m.blocks[0].parameters()) + list(m.blocks[0].buffers()))
    r, pool = attach(m, blocks_to_swap=n)
    swapped = sum(u.used_bytes for u in r.units)
    largest = max(u.used_bytes for u in r.units)
    with torch.inference_mode():
        m(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        m(x)
        peak_swap = torch.cuda.max_memory_allocated()
    extra = peak_swap - (peak_res - swapped)
    assert largest <= block_bytes
    assert extra <= 2 * largest + (1 << 20), (extra, largest)
    detach(m)


def test_pin_failure_fallback_and_cuda_error_cleared(monkeypatch):
    be = CudaBackend(DEV)
    buf = torch.empty(1 << 20, dtype=torch.uint8)
    assert be.pin(buf)
    assert not be.pin(buf)                                    # already registered: a real failure
    torch.ones(8, device=DEV).sum().item()                    # no stale error reported by the next launch
    be.unpin(buf)
    m, ref = make()
    monkeypatch.setattr(CudaBackend, "pin", lambda self, t: False)
    r, pool = attach(m, blocks_to_swap=4)
    with torch.inference_mode():
        x = torch.randn(128, D, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(m(x), ref(x))
    st = r.stats()
    assert st["pinned_bytes"] == 0 and st["pageable_copies"] == st["copies"] > 0
    detach(m)


def test_inference_mode_then_training_views_are_normal_tensors():
    m, ref = make(n=4)
    r, pool = attach(m, blocks_to_swap=4)
    with torch.inference_mode():
        m(torch.randn(16, D, device=DEV, dtype=torch.bfloat16))
    for views in (v for u in r.units for v in u.views.values()):
        assert not any(t.is_inference() for t in views)
    detach(m)


def test_training_checkpoint_grads_match():
    from torch.utils.checkpoint import checkpoint
    m, ref = make(n=6)
    for mm in (m, ref):
        for b in mm.blocks:
            b.lora = nn.Linear(D, D, bias=False, device=DEV, dtype=torch.bfloat16)
    ref.load_state_dict(m.state_dict())
    r, pool = attach(m, blocks_to_swap=6)

    def run(model, it):
        x = model.emb(torch.ones(64, D, device=DEV, dtype=torch.bfloat16))
        for b in it:
            x = checkpoint(lambda b_, x_: b_(x_) + b_.lora(x_), b, x, use_reentrant=False)
        return model.head(x).float().square().mean()

    run(m, m.block_runner.iterate(m.blocks)).backward()
    run(ref, iter(ref.blocks)).backward()
    for b, br in zip(m.blocks, ref.blocks):
        assert torch.equal(b.lora.weight.grad, br.lora.weight.grad)
    detach(m)
    assert pool.pinned_bytes == 0
