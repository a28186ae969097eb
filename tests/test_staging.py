"""StagedModel (optimization/blockswap/staging.py) on the CPU through FakeBackend: the host arenas are pinned once
and kept across runs, a phase on the device gives the resident model's output bit for bit with any set of blocks
streamed, and releasing copies nothing back."""
import gc

import pytest
import torch

from seedvr2bw.optimization.blockswap import FakeBackend, PinnedPool, BlockSwapRunner, ResidentRunner
from seedvr2bw.optimization.blockswap.staging import StagedModel

from test_blockswap_runner import add_derived_cache, make


def host_ptrs(model):
    return [t.data_ptr() for t in list(model.parameters()) + list(model.buffers())]


@pytest.mark.parametrize("swapped", [(), (1, 4, 6), tuple(range(8))])
def test_phase_output_bit_identical_and_release_copies_nothing(swapped):
    m, ref = make()
    staged = StagedModel(m, pool=PinnedPool(1 << 30), small_bytes=0)
    before = host_ptrs(m)
    be = FakeBackend()
    with torch.no_grad():
        for _ in range(2):
            runner = staged.to_device("cpu", swapped, backend=be)
            assert isinstance(runner, BlockSwapRunner if swapped else ResidentRunner)
            assert m.block_runner is runner
            x = torch.randn(4, 32)
            assert torch.equal(m(x), ref(x))
            staged.release()
            assert host_ptrs(m) == before                 # back on the same host arenas: nothing copied back
            assert torch.equal(m(x), ref(x))
    resident_units = len(staged.units) - len(swapped)
    tags = [e[2] for e in be.log if e[0] == "copy" and e[2][1] == "resident"]
    assert len(tags) == 2 * resident_units                # one copy per resident unit per phase, none back


def test_pinned_once_kept_across_runs_and_freed_with_the_model():
    m, _ = make()
    pool = PinnedPool(1 << 30)
    staged = StagedModel(m, pool=pool, small_bytes=0)
    be = FakeBackend()
    for swapped in [(2, 5), (), (0, 1, 2, 3)]:
        staged.to_device("cpu", swapped, backend=be)
        staged.release()
    pins = [e for e in be.log if e[0] == "pin"]
    assert len(pins) == len(staged.units)                 # each arena pinned once, on the first phase
    assert not [e for e in be.log if e[0] == "unpin"]
    assert pool.pinned_bytes == staged.pinned_bytes() > 0
    del staged
    gc.collect()
    assert pool.pinned_bytes == 0                          # the model's stager went away: its pins with it


def test_pinned_cap_pins_the_streamed_blocks_first():
    m, _ = make()
    staged = StagedModel(m, pool=None, small_bytes=0)
    one = staged.unit_bytes("blocks.0")
    pool = PinnedPool(3 * one + 4096 * 3)
    staged = StagedModel(make()[0], pool=pool, small_bytes=0)
    staged.to_device("cpu", (1, 4, 6), backend=FakeBackend())
    for name in staged.units:
        assert pool.is_pinned(staged.owner, name) == (name in ("blocks.1", "blocks.4", "blocks.6")), name
    staged.close()
    assert pool.pinned_bytes == 0


def test_derived_tensors_dropped_on_release():
    m, ref = make(n=4)
    add_derived_cache(m)
    staged = StagedModel(m, pool=PinnedPool(1 << 30), small_bytes=0)
    staged.to_device("cpu", (), backend=FakeBackend())
    with torch.no_grad():
        m(torch.randn(2, 32))
    assert all(b.lin.derived_tensors for b in m.blocks)
    staged.release()
    assert not any(b.lin.derived_tensors for b in m.blocks)


def test_model_without_blocks_stages_its_children():
    enc = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).requires_grad_(False)
    ref = [p.detach().clone() for p in enc.parameters()]
    staged = StagedModel(enc, blocks_attr=None, pool=PinnedPool(1 << 30), small_bytes=0)
    assert set(staged.units) == {"0", "2"} and staged.block_bytes == []
    staged.to_device("cpu", backend=FakeBackend())
    assert all(torch.equal(p, r) for p, r in zip(enc.parameters(), ref))
    staged.release()
    assert not hasattr(enc, "block_runner")


def test_pin_at_load_then_phases_pin_nothing_more():
    m, ref = make()
    pool = PinnedPool(1 << 30)
    staged = StagedModel(m, pool=pool, small_bytes=0)
    be = FakeBackend()
    assert staged.pin("cpu", backend=be) == pool.pinned_bytes > 0
    pins = len([e for e in be.log if e[0] == "pin"])
    staged.to_device("cpu", (0, 3), backend=be)
    with torch.no_grad():
        x = torch.randn(2, 32)
        assert torch.equal(m(x), ref(x))
    staged.release()
    assert len([e for e in be.log if e[0] == "pin"]) == pins


def test_a_pinned_cap_for_the_model_is_kept():
    m, _ = make()
    pool = PinnedPool(1 << 30)
    staged = StagedModel(m, pool=pool, small_bytes=0)
    one = staged.unit_bytes("blocks.0")
    staged.pin("cpu", backend=FakeBackend(), cap=2 * one + 8192)
    assert 0 < pool.pinned_bytes <= 2 * one + 8192


def test_a_model_built_under_inference_mode_stages_and_streams():
    """ComfyUI builds models under torch.inference_mode: their tensors are inference tensors, and device views
    bound to them must be too (a normal view raises 'Inference tensors do not track version counter')."""
    with torch.inference_mode():
        m, ref = make()
        staged = StagedModel(m, pool=PinnedPool(1 << 30), small_bytes=0)
        be = FakeBackend()
        staged.pin("cpu", backend=be)
    for swapped in [(1, 4), (), tuple(range(8))]:
        with torch.inference_mode():
            staged.to_device("cpu", swapped, backend=be)
            x = torch.randn(2, 32)
            assert torch.equal(m(x), ref(x))
            staged.release()
