"""Selective activation checkpointing of FLUX blocks (training/selective_checkpoint.py) on the tiny ComfyUI FLUX:
same gradients as full checkpointing, GEMMs not run again in the backward, the memory estimate, the plan, the
out-of-memory retry and the settings."""
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_training_cpu import train_cfg, tiny_dataset, training_pkg  # noqa: E402
from test_training_helpers import require_comfy, tiny_flux_patcher  # noqa: E402

A = torch.ops.aten


@pytest.fixture(scope="module")
def comfy():
    torch.set_num_threads(1)
    return require_comfy()


@pytest.fixture
def small_k(monkeypatch):
    """The tiny model's K (hidden 48 ...) is below the real threshold; rank 4 stays below this one."""
    import seedvr2bw.training.selective_checkpoint as sc
    monkeypatch.setattr(sc, "MIN_SAVED_K", 16)
    return sc


class _CountGemms(TorchDispatchMode):
    """Counts base+LoRA operators and GEMMs with K >= MIN_SAVED_K that actually run (ops served from the selective
    cache never get here; the operator's inner GEMMs run below this mode)."""

    def __init__(self, sc):
        super().__init__()
        self.sc, self.n = sc, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i = self.sc.GEMM_LHS.get(func)
        if func.name() in self.sc.LORA_OP_NAMES or (i is not None and args[i].shape[-1] >= self.sc.MIN_SAVED_K):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _trainer(tmp_path, **kw):
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    tr = T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, **kw), ds, latent_format=mp.model.latent_format,
                           device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero up weights so every LoRA gets a gradient
        for p in tr.network.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return tr, ds


def _grads(tr, ds, fwd_counter=None, bwd_counter=None):
    from contextlib import nullcontext
    x0 = tr.process_in(ds.latents[0][None])
    cap = ds.items[0].caption
    tr.network.zero_grad(set_to_none=True)
    with tr.network.cast_cache(torch.float32):
        with fwd_counter or nullcontext():
            pred = tr.forward(x0 * 0.5, torch.tensor([0.5]), ds.conds[cap][None], ds.pooled[cap][None], 1.0)
        loss = pred.square().mean()
        with bwd_counter or nullcontext():
            loss.backward()
    return {k: p.grad.clone() for k, p in tr.network.named_parameters()}


def test_selective_gradients_equal_full_and_skip_gemms(comfy, tmp_path, small_k):
    tr, ds = _trainer(tmp_path)
    n_blocks = len(tr.dm.double_blocks) + len(tr.dm.single_blocks)
    runs = {}
    for mode in ("none", "off", "on"):   # no checkpointing, full, selective
        tr.forward.gradient_checkpointing = mode != "none"
        tr.forward.set_selective(mode)
        tr.forward.fast_checkpoint = False  # full checkpointing through torch.utils.checkpoint, as selective does
        fwd, bwd = _CountGemms(small_k), _CountGemms(small_k)
        runs[mode] = (_grads(tr, ds, fwd, bwd), fwd.n, bwd.n)
    assert list(tr.forward.selective_by_shape.values()) == [n_blocks]
    tr.close()
    full, sel = runs["off"][0], runs["on"][0]
    first = "loras.lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
    assert sel[first].abs().sum() > 0
    for k in full:
        assert torch.equal(full[k], sel[k]), k
        assert torch.allclose(runs["none"][0][k], sel[k], rtol=1e-5, atol=1e-7), k
    # full checkpointing's backward runs the blocks' forward GEMMs again; selective's backward runs only the
    # gradient GEMMs, exactly as many as without checkpointing
    assert runs["none"][1] == runs["off"][1] == runs["on"][1] > 0
    assert runs["on"][2] == runs["none"][2] < runs["off"][2], [r[1:] for r in runs.values()]


def test_saved_bytes_estimate_matches_what_is_saved(comfy, tmp_path, small_k):
    """The estimate equals the bytes of the outputs the policy keeps, for a double and a single block."""
    from torch.utils.checkpoint import CheckpointPolicy
    tr, ds = _trainer(tmp_path)
    dm = tr.dm
    kept = {}

    class Measure(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if small_k.save_policy(None, func, *args, **(kwargs or {})) == CheckpointPolicy.MUST_SAVE:
                kept[self.block] = kept.get(self.block, 0) + sum(
                    t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(t, torch.Tensor))
            return out

    mode = Measure()
    orig = tr.forward.run_block

    def ckpt(fn, *tensors, block=None, **kw):
        mode.block = block
        with mode:
            return fn(*tensors)
    tr.forward.run_block = ckpt
    x0 = tr.process_in(ds.latents[0][None])
    cap = ds.items[0].caption
    ctx = ds.conds[cap][None]
    with tr.network.cast_cache(torch.float32):
        tr.forward(x0, torch.tensor([0.5]), ctx, ds.pooled[cap][None], 1.0)
    tr.forward.run_block = orig
    t_img = (x0.shape[-2] // 2) * (x0.shape[-1] // 2)
    for blk in (dm.double_blocks[0], dm.single_blocks[0]):
        assert kept[blk] > 0
        assert small_k.saved_bytes(blk, 1, t_img, ctx.shape[1], 4) == kept[blk], type(blk).__name__
    tr.close()


def test_plan_fits_blocks_in_free_memory():
    from seedvr2bw.training.selective_checkpoint import HEADROOM_BYTES, plan_selective_blocks
    gib = 1 << 30
    costs = [gib // 4] * 57
    assert plan_selective_blocks(costs, 80 * gib, 2 * gib) == 57
    free = 2 * gib + 3 * costs[0] + HEADROOM_BYTES + 10 * costs[0]
    assert plan_selective_blocks(costs, free, 2 * gib) == 10
    assert plan_selective_blocks(costs, 4 * gib, 2 * gib) == 0
    assert plan_selective_blocks([], gib, 0) == 0


def test_auto_is_off_on_cpu_and_logged(comfy, tmp_path, caplog):
    tr, ds = _trainer(tmp_path)   # selective_checkpointing="auto" by default
    with caplog.at_level(logging.INFO):
        _grads(tr, ds)
    assert list(tr.forward.selective_by_shape.values()) == [0]
    assert any("selective checkpointing for input" in r.getMessage() and "auto: device cpu" in r.getMessage()
               for r in caplog.records)
    tr.close()


def test_out_of_memory_retries_with_full_checkpointing(comfy, tmp_path, caplog):
    tr, ds = _trainer(tmp_path, selective_checkpointing="on", steps=1)
    real, calls = tr.loss_and_grads, []

    def flaky(*inputs):
        out = real(*inputs)
        calls.append(tr.forward.selective_now)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return out
    tr.loss_and_grads = flaky
    with caplog.at_level(logging.WARNING):
        loss = tr.train_step()
    assert calls[0] > 0 and calls[1] == 0 and loss == loss
    assert any("retrying with full per-block checkpointing" in r.getMessage() for r in caplog.records)
    tr.close()


def test_setting_validation_and_env(comfy, tmp_path, monkeypatch):
    T = training_pkg()
    with pytest.raises(ValueError, match=r"unknown selective_checkpointing setting 'fast'.*auto, on, off"):
        T.TrainConfig(selective_checkpointing="fast").validate()
    monkeypatch.setenv("SEEDVR2BW_TRAIN_SELECTIVE_CKPT", "0")
    tr, _ = _trainer(tmp_path, selective_checkpointing="on")
    assert tr.forward.selective == "off"
    tr.close()
    monkeypatch.setenv("SEEDVR2BW_TRAIN_SELECTIVE_CKPT", "sometimes")
    with pytest.raises(ValueError, match="SEEDVR2BW_TRAIN_SELECTIVE_CKPT='sometimes'.*auto, on, off"):
        _trainer(tmp_path / "b", selective_checkpointing="on")
