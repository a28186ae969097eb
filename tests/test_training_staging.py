"""The trainer honouring the memory plan on a small card (training/staging.py), on the CPU through FakeBackend: a
run with blocks streamed from host arenas and a quantized base (fp8, NVFP4 by CPU emulation) gives the LoRA of the
resident run of the same base, the swapped blocks travel in their stored formats, and after the run every model
tensor is on host storage again (nothing copied back, nothing left in the fake GPU's buffers)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_training_cpu import _fixed_eval, _model_out, tiny_dataset, train_cfg, training_pkg  # noqa: E402
from test_training_helpers import require_comfy, tiny_flux_patcher  # noqa: E402


@pytest.fixture(scope="module")
def comfy():
    torch.set_num_threads(1)
    return require_comfy()


class RecordingBackend:
    """A FakeBackend whose allocations (the fake GPU's memory) are remembered, to check none is still used."""

    def __new__(cls):
        from seedvr2bw.optimization.blockswap import FakeBackend

        class _B(FakeBackend):
            def __init__(self):
                super().__init__()
                self.buffers = []

            def alloc(self, nbytes):
                buf = super().alloc(nbytes)
                self.buffers.append((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()))
                return buf
        return _B()


def _tensors(dm):
    return dict(list(dm.named_parameters()) + list(dm.named_buffers()))


def _quantized_dtypes(tr, name):
    return {r.dtype for r in tr.staging.staged.units[name][1].records}


def _run(comfy, tmp_path, ds, mp, mode, swap, steps=6):
    T = training_pkg()
    from seedvr2bw.optimization.blockswap import BlockSwapConfig, PinnedPool
    dm = mp.model.diffusion_model
    kw = {}
    if swap is not None:
        kw = dict(blockswap_backend=RecordingBackend(), blockswap_pool=PinnedPool(cap_bytes=1 << 30),
                  blockswap_config=BlockSwapConfig(blocks_to_swap=0, small_tensor_bytes=0))
    cfg = train_cfg(tmp_path, steps=steps, base_precision=mode, blocks_to_swap=swap or 0,
                    output_name=f"st_{mode}_{swap}")
    return T.FluxLoraTrainer(dm, cfg, ds, latent_format=mp.model.latent_format, device="cpu", **kw)


@pytest.mark.parametrize("mode", ["auto", "fp8", "nvfp4"])
def test_swapped_run_equals_resident_run_and_leaves_the_model_on_the_host(comfy, tmp_path, mode):
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    out0 = _model_out(dm)
    sd0 = {k: v.clone() for k, v in dm.state_dict().items()}
    ptr0 = {k: t.data_ptr() for k, t in _tensors(dm).items()}
    loras, losses = [], []
    for swap in (None, 3):
        tr = _run(comfy, tmp_path, ds, mp, mode, swap)
        if swap:
            be = tr.staging.block_runner.backend
            st = tr.block_runner.stats()
            assert st["swapped_bytes"] > 0 and len(st["swapped_indices"]) == 3
            name = f"blocks.{st['swapped_indices'][0]}"
            want = {"auto": torch.float32, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[mode]
            assert want in _quantized_dtypes(tr, name)        # the swapped block travels in its stored format
            if mode != "auto":   # and without its high-precision Linear weights (they wait on the host)
                recs = tr.staging.staged.units[name][1].records
                assert all(r.nbytes == 0 for r in recs if r.name.endswith(".weight") and len(r.shape) == 2)
            before = _fixed_eval(tr)
        tr.run()
        if swap:
            assert _fixed_eval(tr) < before                   # the loss falls with blocks streamed
            host = {t.data_ptr() for t in tr.staging.host_tensors()}
        loras.append({k: v.clone() for k, v in tr.network.state_dict().items()})
        losses.append(list(tr.losses))
        tr.close()
    # bit for bit the LoRA of the resident run of the same base (same arithmetic; only where the weights live differs)
    for k in loras[0]:
        assert torch.equal(loras[0][k], loras[1][k]), (k, (loras[0][k] - loras[1][k]).abs().max())
    assert losses[0] == losses[1]
    # after the run: the model as it was, every tensor on host storage, none in the fake GPU's buffers
    assert torch.equal(_model_out(dm), out0)
    for k, v in dm.state_dict().items():
        assert torch.equal(v, sd0[k]) and v.dtype == sd0[k].dtype, k
    for k, t in _tensors(dm).items():
        p = t.data_ptr()
        assert not any(lo <= p < hi for lo, hi in be.buffers), k
        assert p == ptr0[k] or p in host, k                   # its own storage, or its host arena (no copy back)
    copies = [e for e in be.log if e[0] == "copy"]
    assert copies and all(e[2][1] == "resident" or isinstance(e[2][1], int) for e in copies)


def test_quantized_weights_set_aside_without_a_copy(comfy, tmp_path):
    """The high-precision weights a quantized base sets aside stay the model's own host tensors (same storage)."""
    Q = __import__("seedvr2bw.training.quant", fromlist=["block_linears"])
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    ptrs = {n: lin.weight.data_ptr() for n, lin in Q.block_linears(dm)}
    tr = _run(comfy, tmp_path, ds, mp, "fp8", 2, steps=1)
    assert all(lin.weight.numel() == 0 for _, lin in Q.block_linears(dm))   # not staged: only the e4m3 copy is
    tr.run()
    tr.close()
    assert {n: lin.weight.data_ptr() for n, lin in Q.block_linears(dm)} == ptrs


def test_swap_without_checkpointing_is_refused(comfy, tmp_path):
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, blocks_to_swap=2,
                                                              gradient_checkpointing=False), ds, device="cpu")
