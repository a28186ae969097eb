"""BlockSwapRunner scheduling on the CPU through FakeBackend (lazy copy stream: a missing wait shows as a wrong
output): which blocks, order, prefetch depth, wrap-around, events, no host syncs, bit-identical output,
exception safety, detach, training (checkpointed backward in reverse order)."""
import copy
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from seedvr2bw.optimization.blockswap import (BlockSwapConfig, BlockSwapRunner, FakeBackend, PinnedPool,
                                               ResidentRunner, attach_blockswap, detach, spread_indices)


class Block(nn.Module):
    def __init__(self, d, fp8=False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.register_buffer("gate", torch.randn(d))
        self.register_buffer("codes", torch.randint(0, 255, (d, d // 2), dtype=torch.uint8))  # NVFP4-like storage
        self.fp8 = fp8
        if fp8:
            self.w8 = nn.Parameter(torch.randn(d, d).to(torch.float8_e4m3fn), requires_grad=False)

    def forward(self, x):
        h = self.lin(self.norm(x))
        if self.fp8:
            h = h + x @ self.w8.to(x.dtype).t() * 0.01          # up-cast on the compute device
        h = h + self.codes[:, :1].to(x.dtype).t() * 1e-3
        return x + torch.tanh(h) * self.gate


class Model(nn.Module):
    def __init__(self, n=8, d=32, fp8=False):
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, fp8=fp8 and i % 2 == 0) for i in range(n)])
        self.out = nn.Linear(d, d)
        self.block_runner = ResidentRunner()

    def forward(self, x):
        x = self.emb(x)
        for b in self.block_runner.iterate(self.blocks):
            x = b(x)
        return self.out(x)


def make(n=8, d=32, fp8=False, seed=0):
    torch.manual_seed(seed)
    m = Model(n, d, fp8).requires_grad_(False)
    return m, copy.deepcopy(m)


def add_derived_cache(model):
    """Give each block's linear a cache derived from its weight, dropped by drop_derived() (as NVFP4Linear does)."""
    for b in model.blocks:
        b.lin.derived_tensors = {}
        b.lin.drop_derived = b.lin.derived_tensors.clear
        orig = b.lin.forward

        def fwd(x, lin=b.lin, orig=orig):
            lin.derived_tensors.setdefault("w", lin.weight.clone())
            return orig(x)
        b.lin.forward = fwd


def attach(model, backend=None, pool=None, **cfg):
    backend = backend or FakeBackend()
    pool = pool or PinnedPool(1 << 30)
    cfg.setdefault("small_tensor_bytes", 0)          # toy tensors are tiny: stream them all
    runner = attach_blockswap(model, BlockSwapConfig(**cfg), backend=backend, pool=pool)
    return runner, backend, pool


def copies(backend):
    return [e[2][0] for e in backend.log if e[0] == "copy"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n_swap,prefetch,buffers", [(3, 1, 2), (8, 1, 2), (5, 2, 3), (1, 1, 2), (8, 3, 4)])
def test_bit_identical_to_resident(n_swap, prefetch, buffers, fp8):
    m, ref = make(fp8=fp8)
    runner, be, pool = attach(m, blocks_to_swap=n_swap, prefetch=prefetch, buffers=buffers)
    assert isinstance(runner, BlockSwapRunner)
    assert runner.swapped_indices == spread_indices(8, n_swap)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 32)
            assert torch.equal(m(x), ref(x))
    st = runner.stats()
    assert st["pageable_copies"] == 0 and st["pinned_copies"] == st["copies"]
    assert be.host_syncs == 0                                    # no host waits on the hot path
    detach(m)
    assert pool.pinned_bytes == 0 and not be.pinned


def test_stored_dtypes_travel_unchanged():
    m, ref = make(fp8=True)
    runner, be, pool = attach(m, blocks_to_swap=8)
    b0 = m.blocks[0]
    assert b0.w8.dtype == torch.float8_e4m3fn and b0.codes.dtype == torch.uint8
    arena = runner.units[0].arena
    assert arena.payload_bytes == sum(t.numel() * t.element_size()
                                      for t in list(ref.blocks[0].parameters()) + list(ref.blocks[0].buffers()))
    # the module's tensors are views of the arena: one host copy
    base = arena.buffer.data_ptr()
    for r in arena.records:
        assert base <= r.tensor.data_ptr() < base + arena.nbytes
        assert r.offset % 256 == 0
    assert torch.equal(b0.w8.view(torch.uint8), ref.blocks[0].w8.view(torch.uint8))


def test_schedule_order_prefetch_and_events():
    m, ref = make(n=8)
    runner, be, pool = attach(m, blocks_to_swap=4, prefetch=1, buffers=2)   # blocks 1, 3, 5, 7
    assert runner.swapped_indices == [1, 3, 5, 7]
    assert [u.name for u in runner.units] == ["blocks.1", "blocks.3", "blocks.5", "blocks.7"]
    be.log.clear()
    with torch.no_grad():
        m(torch.randn(2, 32))
    assert copies(be) == ["blocks.1", "blocks.3", "blocks.5", "blocks.7", "blocks.1"]   # + wrap-around
    st = runner.stats()
    assert st["demand_loads"] == 0 and st["prefetched"] == 5 and st["slot_hits"] == 4
    # every copy into a reused slot waits on that slot's free event, recorded on the compute stream after the
    # previous occupant was used; the compute waits on the slot's ready event before each swapped block
    recorded_free = {}
    for i, e in enumerate(be.log):
        if e[0] == "record" and e[1] == "compute":
            recorded_free[e[2]] = i
    slot_free_ids = {s.free.id for s in runner.slots}
    slot_ready_ids = {s.ready.id for s in runner.slots}
    copy_waits = [e for e in be.log if e[0] == "wait" and e[1] != "compute"]
    assert len(copy_waits) == 3 and all(e[2] in slot_free_ids and e[2] in recorded_free for e in copy_waits)
    compute_waits = [e for e in be.log if e[0] == "wait" and e[1] == "compute"]
    assert len(compute_waits) == 4 and all(e[2] in slot_ready_ids for e in compute_waits)
    # steady state: the next pass starts from the prefetched first block and copies each swapped block once
    be.log.clear()
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
    assert copies(be) == ["blocks.3", "blocks.5", "blocks.7", "blocks.1"]
    assert be.host_syncs == 0


def test_prefetch_depth_two():
    m, _ = make(n=8)
    runner, be, _ = attach(m, blocks_to_swap=8, prefetch=2, buffers=3)
    be.log.clear()
    issued = []
    with torch.no_grad():
        x = m.emb(torch.randn(2, 32))
        for i, b in enumerate(m.block_runner.iterate(m.blocks)):
            issued.append(len(copies(be)))
            x = b(x)
    # when block i runs, blocks up to i+2 have been issued
    assert issued == [3, 4, 5, 6, 7, 8, 9, 10][:8] or issued[:6] == [3, 4, 5, 6, 7, 8]
    assert all(c >= min(i + 3, 8) for i, c in enumerate(issued))
    assert runner.stats()["demand_loads"] == 0


def test_few_swapped_blocks_stay_in_ring():
    m, ref = make(n=8)
    runner, be, _ = attach(m, blocks_to_swap=2, buffers=2)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 32)
            assert torch.equal(m(x), ref(x))
    assert runner.stats()["copies"] == 2                         # loaded once, then kept: no re-copies


def test_ring_size_and_vram_bound():
    m, ref = make(n=8, fp8=True)
    runner, be, _ = attach(m, blocks_to_swap=4)
    largest = max(u.used_bytes for u in runner.units)
    assert runner.slot_bytes < largest + 256
    assert be.allocated == runner.ring_bytes <= 2 * (largest + 256)


def test_blocks_called_outside_iterate_get_weights():
    m, ref = make(n=8)
    runner, be, _ = attach(m, blocks_to_swap=8)
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m.blocks[5](x), ref.blocks[5](x))     # forward hook materialises it
        assert torch.equal(m.blocks[2](x), ref.blocks[2](x))
    assert m.blocks[5].lin.weight.device.type == "cpu"


def test_exception_mid_run_then_detach():
    m, ref = make(n=8)
    runner, be, pool = attach(m, blocks_to_swap=6)
    with torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            for i, b in enumerate(m.block_runner.iterate(m.blocks)):
                if i == 4:
                    raise KeyboardInterrupt        # a cancelled run
                b(torch.randn(2, 32))
        # the runner is still consistent: the next run is right
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
        # an abandoned generator (exception in model code, generator not closed) does not leak a slot
        it = m.block_runner.iterate(m.blocks)
        for _ in range(3):
            next(it)
        assert torch.equal(m(x), ref(x))
    detach(m)
    assert pool.pinned_bytes == 0 and not be.pinned
    assert isinstance(m.block_runner, ResidentRunner)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))                          # weights intact on the host


def test_released_model_unpins():
    pool = PinnedPool(1 << 30)
    be = FakeBackend()
    m, _ = make(n=8)
    attach(m, backend=be, pool=pool, blocks_to_swap=4)
    assert pool.pinned_bytes > 0
    del m
    gc.collect()
    assert pool.pinned_bytes == 0 and not be.pinned


def test_pinning_fallback_pageable_still_correct(caplog):
    m, ref = make(n=8)
    runner, be, pool = attach(m, backend=FakeBackend(pin_fail=True), blocks_to_swap=5)
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
    st = runner.stats()
    assert st["pinned_bytes"] == 0 and st["pageable_copies"] == st["copies"] > 0
    assert st["pool"]["pin_failures"] == 1          # no retries after a failure
    assert any("pageable" in r.message for r in caplog.records)


def test_pinned_cap_partial():
    m, ref = make(n=8)
    block = sum(t.numel() * t.element_size() for t in list(ref.blocks[0].parameters()) + list(ref.blocks[0].buffers()))
    cap = 2 * (block + 8192)
    runner, be, pool = attach(m, blocks_to_swap=4, pinned_cap_bytes=cap)
    st = runner.stats()
    assert 0 < st["pinned_bytes"] <= cap
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
    st = runner.stats()
    assert st["pinned_copies"] > 0 and st["pageable_copies"] > 0


def test_two_models_share_pool_lru():
    be = FakeBackend()
    m1, _ = make(n=4, seed=1)
    m2, _ = make(n=4, seed=2)
    probe, _ = make(n=4, seed=3)
    r_probe, _, p0 = attach(probe, blocks_to_swap=4)
    one = r_probe.units[0].arena.nbytes
    pool = PinnedPool(cap_bytes=5 * one)
    r1, _, _ = attach(m1, backend=be, pool=pool, blocks_to_swap=4)
    assert r1.stats()["pinned_bytes"] == 4 * one
    r2, _, _ = attach(m2, backend=be, pool=pool, blocks_to_swap=4)       # evicts m1's LRU pins
    assert r2.stats()["pinned_bytes"] == 4 * one and r1.stats()["pinned_bytes"] == one
    assert pool.stats()["evictions"] == 3
    detach(m2)
    with torch.no_grad():
        m1(torch.randn(2, 32))                                           # room again: m1 re-pins on use
    assert r1.stats()["pinned_bytes"] == 4 * one


def test_auto_plan_from_free_vram():
    m, ref = make(n=8)
    block = sum(t.numel() * t.element_size() for t in list(ref.blocks[0].parameters()) + list(ref.blocks[0].buffers()))
    other = sum(t.numel() * t.element_size() for n_, t in ref.named_parameters() if not n_.startswith("blocks"))
    # room for other + 4 blocks + ring of 2: 4 swapped
    free = other + 6 * block + 1000
    be = FakeBackend(vram=(free, 10 * free))
    runner, _, _ = attach(m, backend=be, blocks_to_swap="auto", reserve_bytes=0)
    assert len(runner.swapped_indices) == 4
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
    # plenty of VRAM: resident
    m2, _ = make(n=8)
    r2, _, _ = attach(m2, backend=FakeBackend(vram=(1 << 40, 1 << 41)), blocks_to_swap="auto")
    assert isinstance(r2, ResidentRunner)


def test_swap_io_components():
    m, ref = make(n=6)
    runner, be, _ = attach(m, blocks_to_swap=6, swap_io_components=True, buffers=2)
    assert [u.name for u in runner.units] == ["emb"] + [f"blocks.{i}" for i in range(6)] + ["out"]
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 32)
            assert torch.equal(m(x), ref(x))
    assert m.emb.weight.device.type == "cpu"
    be.log.clear()
    runner.reset_stats()
    with torch.no_grad():
        m(torch.randn(2, 32))
    assert copies(be) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5", "out", "emb"]
    assert runner.stats()["demand_loads"] == 0


def test_reverse_iterate():
    m, ref = make(n=6)
    runner, be, _ = attach(m, blocks_to_swap=6)
    be.log.clear()
    with torch.no_grad():
        x = torch.randn(2, 32)
        y, yr = x, x
        for b in m.block_runner.iterate(m.blocks, reverse=True):
            y = b(y)
        for b in reversed(ref.blocks):
            yr = b(yr)
    assert torch.equal(y, yr)
    assert copies(be)[:6] == [f"blocks.{i}" for i in (5, 4, 3, 2, 1, 0)]


def test_training_checkpoint_reverse_order_and_grads():
    """LoRA-style training: frozen swapped base, trainable adapters resident, checkpoint per block."""
    torch.manual_seed(0)
    m, ref = make(n=6)
    for mm in (m, ref):
        for b in mm.blocks:
            b.lora = nn.Linear(32, 32, bias=False)
            nn.init.normal_(b.lora.weight, std=0.02)
    ref.load_state_dict(m.state_dict())

    def fwd(model, x, runner_iter):
        x = model.emb(x)
        for b in runner_iter:
            x = checkpoint(lambda b_, x_: b_(x_) + b_.lora(x_), b, x, use_reentrant=False)
        return model.out(x).square().mean()

    runner, be, pool = attach(m, blocks_to_swap=6)
    assert all(b.lora.weight.requires_grad for b in m.blocks)
    assert all(not any(r.tensor is b.lora.weight for r in u.arena.records) for u, b in zip(runner.units, m.blocks))
    x = torch.randn(4, 32)
    be.log.clear()
    loss = fwd(m, x, m.block_runner.iterate(m.blocks))
    loss.backward()
    loss_r = fwd(ref, x, iter(ref.blocks))
    loss_r.backward()
    assert torch.equal(loss, loss_r)
    for b, br in zip(m.blocks, ref.blocks):
        assert torch.equal(b.lora.weight.grad, br.lora.weight.grad)
    cp = copies(be)
    # forward 0..5 (no wrap while grad is on), then backward re-materialises 5..0; 4 and 5 are still in the ring
    assert cp[:6] == [f"blocks.{i}" for i in range(6)]
    assert cp[6:] == [f"blocks.{i}" for i in (3, 2, 1, 0)]
    detach(m)
    assert pool.pinned_bytes == 0


def test_closed_runner_refuses_and_detach_twice():
    m, _ = make(n=4)
    runner, be, pool = attach(m, blocks_to_swap=2)
    detach(m)
    detach(runner)                         # second release: no-op
    with pytest.raises(RuntimeError):
        next(runner.iterate(m.blocks))


def test_detach_restore_cpu_keeps_single_host_copy():
    m, ref = make(n=4)
    runner, be, pool = attach(m, blocks_to_swap=4)
    arena = runner.units[0].arena.buffer
    detach(m, restore_device="cpu")
    w = m.blocks[0].lin.weight
    assert arena.data_ptr() <= w.data_ptr() < arena.data_ptr() + arena.numel()   # no copy made
    assert pool.pinned_bytes == 0
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))


def test_small_tensors_stay_resident():
    m, ref = make(n=4, d=128)
    runner, be, pool = attach(m, blocks_to_swap=4, small_tensor_bytes=16384)
    names = [r.name for r in runner.units[0].arena.records]
    assert names == ["lin.weight"]                     # 64 KiB; codes (8 KiB), gate, norm, bias stay
    assert "gate" not in names and "norm.weight" not in names and "lin.bias" not in names
    with torch.no_grad():
        x = torch.randn(2, 128)
        assert torch.equal(m(x), ref(x))


def test_derived_weight_caches_dropped_on_eviction():
    """Modules caching tensors derived from their weights (NVFP4Linear.derived_tensors, dropped by its
    drop_derived()) must not keep them for a block that left the ring, or each swapped block would leave a derived
    GPU copy behind."""
    m, ref = make(n=6)
    add_derived_cache(m)
    runner, be, _ = attach(m, blocks_to_swap=6)
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
    alive = [i for i, b in enumerate(m.blocks) if b.lin.derived_tensors]
    assert len(alive) <= 2                                  # only blocks still in the ring keep their cache
    detach(m)
    assert not any(b.lin.derived_tensors for b in m.blocks)


def test_pack_quantized_linears_travel_in_storage_format():
    """Blocks holding the pack's NVFP4Linear / FP8Linear (uint8 + e4m3 scales + fp32 scalars) swap bit-exactly."""
    lin = pytest.importorskip("seedvr2bw.optimization.nvfp4.linear")
    torch.manual_seed(0)
    m, _ = make(n=4, d=64)
    for i, b in enumerate(m.blocks):
        src = nn.Linear(64, 64)
        b.lin = (lin.NVFP4Linear.from_linear(src, path="reference") if i % 2 == 0
                 else lin.FP8Linear.from_linear(src)).requires_grad_(False)
    ref = copy.deepcopy(m)
    runner, be, pool = attach(m, blocks_to_swap=4)
    rec = {r.name: r.dtype for r in runner.units[0].arena.records}
    assert rec["lin.weight"] == torch.uint8 and rec["lin.weight_scale"] == torch.float8_e4m3fn
    assert runner.units[1].arena.records[0].dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 64)
            assert torch.equal(m(x), ref(x))
    detach(m)


def test_weight_tied_across_swapped_blocks_stays_resident():
    m, _ = make(n=4)
    m.blocks[3].lin.weight = m.blocks[1].lin.weight            # tied across two swapped blocks
    ref = copy.deepcopy(m)
    runner, be, pool = attach(m, blocks_to_swap=4)
    names = [[r.name for r in u.arena.records] for u in runner.units]
    assert "lin.weight" not in names[1] and "lin.weight" not in names[3] and "lin.weight" in names[0]
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
    detach(m)


def test_training_without_checkpoint_fails_loudly():
    """Autograd tensors saved from a swapped block alias its ring slot; once the slot is refilled the backward
    must raise rather than use another block's weights."""
    m, _ = make(n=6)

    def fwd_views(b, x):                      # x @ W.t() saves the view W.t() of the slot
        return x + torch.tanh(x @ b.lin.weight.t())
    runner, be, pool = attach(m, blocks_to_swap=6)
    x = torch.randn(2, 32, requires_grad=True)
    y = x
    for b in m.block_runner.iterate(m.blocks):
        y = fwd_views(b, y)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()
    detach(m)
