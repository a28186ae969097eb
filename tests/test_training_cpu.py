"""FLUX LoRA trainer on CPU with a tiny FLUX built from ComfyUI's own class (comfy.ldm.flux.model.Flux)."""
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_training_helpers import (FakeCLIP, FakeVAE, make_image_folder, require_comfy,  # noqa: E402
                                   tiny_flux_patcher)


@pytest.fixture(scope="module")
def comfy():
    torch.set_num_threads(1)  # tiny model: threads only add contention on shared CI boxes
    return require_comfy()


def training_pkg():
    import seedvr2bw.training as T
    return T


def tiny_dataset(tmp_path, n=2, **kw):
    T = training_pkg()
    folder = make_image_folder(tmp_path / "ds", n=n)
    return T.encode_dataset(T.DatasetSpec(folder=str(folder), resolution=64, **kw), FakeVAE(), FakeCLIP(),
                            cache_dir=str(tmp_path / "cache"))


def train_cfg(tmp_path, **kw):
    T = training_pkg()
    base = dict(rank=4, alpha=4, steps=40, learning_rate=3e-3, compute_dtype="fp32", output_dir=str(tmp_path / "out"),
                output_name="tiny", seed=7)
    base.update(kw)
    return T.TrainConfig(**base)


def _fixed_eval(trainer, n=6):
    """Loss at fixed noise/sigmas over the dataset (deterministic, no grad)."""
    from seedvr2bw.training.objective import noisy_input, flow_loss
    g = torch.Generator().manual_seed(999)
    tot = 0.0
    with torch.no_grad():
        for k in range(n):
            i = k % len(trainer.data)
            x0 = trainer.process_in(trainer.data.latents[i][None])
            cap = trainer.data.items[i].caption
            noise = torch.randn(x0.shape, generator=g)
            sigma = torch.tensor([0.2 + 0.6 * k / max(1, n - 1)])
            x_t, target = noisy_input(x0, noise, sigma)
            pred = trainer.forward(x_t, sigma, trainer.data.conds[cap][None], trainer.data.pooled[cap][None], 1.0)
            tot += float(flow_loss(pred, target))
    return tot / n


def _model_out(dm, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 8, 8, generator=g)
    ctx = torch.randn(1, 8, 48, generator=g)
    y = torch.randn(1, 32, generator=g)
    with torch.no_grad():
        return dm(x, torch.tensor([0.6]), ctx, y=y, guidance=torch.tensor([1.0]))


def test_loss_falls_and_lora_loads_in_comfyui(comfy, tmp_path, caplog):
    T = training_pkg()
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    before_base = _model_out(dm)
    ds = tiny_dataset(tmp_path)
    tr = T.FluxLoraTrainer(dm, train_cfg(tmp_path, steps=50, learning_rate=5e-3), ds, latent_format=mp.model.latent_format, device="cpu")
    assert len(tr.network.loras) == 2 * 10 + 2 * 3  # kohya targets: 10 per double block, 3 per single block
    l0 = _fixed_eval(tr)
    path = tr.run()
    l1 = _fixed_eval(tr)
    assert l1 < 0.7 * l0, (l0, l1)
    trained_out = _model_out(dm)
    tr.close()
    assert torch.equal(_model_out(dm), before_base)  # hooks removed: base model untouched

    import comfy.sd
    import comfy.utils
    sd = comfy.utils.load_torch_file(path)
    assert all(k.startswith("lora_unet_") for k in sd)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in sd
    assert "lora_unet_single_blocks_1_linear2.alpha" in sd
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        md = f.metadata()
    assert md["ss_network_dim"] == "4" and md["ss_network_module"] == "networks.lora_flux"

    # load with fp32 save to check the numerical round trip (bf16 files are rounded by design)
    tr2 = T.FluxLoraTrainer(dm, train_cfg(tmp_path, steps=1, save_dtype="fp32", output_name="fp32copy"), ds,
                            latent_format=mp.model.latent_format, device="cpu")
    tr2.network.load_state_dict(tr.network.state_dict())
    p32 = tr2.save_lora()
    out_hook = _model_out(dm)
    tr2.close()
    assert torch.allclose(out_hook, trained_out)

    caplog.set_level(logging.WARNING)
    lora = comfy.utils.load_torch_file(p32)
    mp2, _ = comfy.sd.load_lora_for_models(mp, None, lora, 1.0, 0.0)
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    import comfy.model_management
    comfy.model_management.load_models_gpu([mp2], force_full_load=True)
    out_comfy = _model_out(mp2.model.diffusion_model)
    rel = (out_comfy - trained_out).norm() / trained_out.norm()
    assert rel <= 1e-4, float(rel)
    mp2.unpatch_model()


def test_lora_loader_node_no_missing_keys(comfy, tmp_path, caplog):
    """ComfyUI's LoraLoaderModelOnly node resolves the file from models/loras and loads every key."""
    T = training_pkg()
    import folder_paths
    mp = tiny_flux_patcher()
    ds = tiny_dataset(tmp_path)
    loras = tmp_path / "loras"
    tr = T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, steps=3, output_dir=str(loras)), ds,
                           latent_format=mp.model.latent_format, device="cpu")
    tr.run()
    tr.close()
    folder_paths.add_model_folder_path("loras", str(loras), is_default=True)
    import nodes
    caplog.set_level(logging.WARNING)
    (m2,) = nodes.LoraLoaderModelOnly().load_lora_model_only(mp, "tiny.safetensors", 1.0)
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert len(m2.patches) == 26


def test_resume_equals_uninterrupted(comfy, tmp_path):
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    for opt in ("adamw", "prodigy"):
        if opt == "prodigy":
            pytest.importorskip("prodigyopt")
        kw = dict(steps=8, optimizer=opt, lr_scheduler="cosine", warmup_steps=3, grad_accum=2,
                  learning_rate=1.0 if opt == "prodigy" else 3e-3)
        full = T.FluxLoraTrainer(dm, train_cfg(tmp_path, output_name=f"full_{opt}", **kw), ds,
                                 latent_format=mp.model.latent_format, device="cpu")
        full.run()
        ref = {k: v.clone() for k, v in full.network.state_dict().items()}
        full.close()

        part = T.FluxLoraTrainer(dm, train_cfg(tmp_path, output_name=f"part_{opt}", **kw), ds,
                                 latent_format=mp.model.latent_format, device="cpu")
        for _ in range(3):
            part.train_step()
        part.save_state()
        part.close()
        torch.manual_seed(12345)  # disturb the global RNG: resume must restore it
        res = T.FluxLoraTrainer(dm, train_cfg(tmp_path, output_name=f"part_{opt}", **kw), ds,
                                latent_format=mp.model.latent_format, device="cpu")
        res.load_state()
        assert res.step == 3
        res.run()
        got = res.network.state_dict()
        res.close()
        for k in ref:
            assert torch.equal(ref[k], got[k]), (opt, k)
        assert res.losses == full.losses


def test_checkpointing_gradients_match(comfy, tmp_path):
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    grads = []
    for ckpt in (False, True):
        tr = T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, gradient_checkpointing=ckpt), ds,
                               latent_format=mp.model.latent_format, device="cpu")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # non-zero up weights so every LoRA gets a gradient
            for p in tr.network.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        x0, ctx, y = ds.latents[0][None], ds.conds[ds.items[0].caption][None], ds.pooled[ds.items[0].caption][None]
        x0 = tr.process_in(x0)
        pred = tr.forward(x0 * 0.5, torch.tensor([0.5]), ctx, y, 1.0)
        pred.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in tr.network.parameters()]))
        assert all(p.grad is None for p in mp.model.diffusion_model.parameters())  # no base weight grads
        tr.close()
    rel = (grads[0] - grads[1]).norm() / grads[0].norm()
    assert rel < 1e-5, float(rel)


def test_periodic_saves_keep_last_and_cancel_saves(comfy, tmp_path):
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    tr = T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, steps=10, save_every=2, keep_last=2), ds,
                           latent_format=mp.model.latent_format, device="cpu")
    calls = {"n": 0}

    class Cancel(Exception):
        pass

    def check():
        calls["n"] += 1
        if calls["n"] == 8:
            raise Cancel()
    with pytest.raises(Cancel):
        tr.run(check_interrupt=check)
    tr.close()
    out = Path(tmp_path / "out")
    steps = sorted(p.name for p in out.glob("tiny-step*.safetensors"))
    assert steps == ["tiny-step00000004.safetensors", "tiny-step00000006.safetensors"]
    assert (out / "tiny.safetensors").is_file() and (out / "tiny-state.pt").is_file()
    assert not list(out.glob("*.tmp-*"))
    st = torch.load(out / "tiny-state.pt", weights_only=False)
    assert st["step"] == 7


def test_dataset_cache_reused(comfy, tmp_path):
    T = training_pkg()
    folder = make_image_folder(tmp_path / "ds", n=3, size=(96, 64))
    vae, clip = FakeVAE(), FakeCLIP()
    spec = T.DatasetSpec(folder=str(folder), resolution=128, bucket_step=32)
    d1 = T.encode_dataset(spec, vae, clip, cache_dir=str(tmp_path / "c"))
    assert not d1.from_cache and vae.calls == 3
    d2 = T.encode_dataset(spec, vae, clip, cache_dir=str(tmp_path / "c"))
    assert d2.from_cache and vae.calls == 3
    assert all(torch.equal(a, b) for a, b in zip(d1.latents, d2.latents))
    (folder / "img0.txt").write_text("changed caption")
    d3 = T.encode_dataset(spec, vae, clip, cache_dir=str(tmp_path / "c"))
    assert not d3.from_cache
    # 96x64 (3:2) goes to a landscape bucket
    assert d1.items[0].bucket[0] > d1.items[0].bucket[1]


def test_image_batch_dataset(comfy, tmp_path):
    T = training_pkg()
    imgs = torch.rand(2, 64, 64, 3)
    ds = T.encode_dataset(T.DatasetSpec(images=imgs, captions=["a", "b"], resolution=64), FakeVAE(), FakeCLIP())
    assert len(ds) == 2 and set(ds.conds) == {"a", "b", ""}  # "": the empty caption, for caption dropout


@pytest.mark.parametrize("mode", ["fp8", "nvfp4"])
def test_quantized_base_cpu_fallback(comfy, tmp_path, mode):
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    ref = _model_out(dm)
    w0 = dm.single_blocks[0].linear1.weight.detach().clone()
    tr = T.FluxLoraTrainer(dm, train_cfg(tmp_path, steps=3, base_precision=mode), ds, latent_format=mp.model.latent_format,
                           device="cpu")
    q = _model_out(dm)
    rel = float((q - ref).norm() / ref.norm())
    assert rel < (0.05 if mode == "fp8" else 0.3), rel
    tr.run()
    tr.close()
    assert torch.equal(dm.single_blocks[0].linear1.weight, w0)
    assert torch.equal(_model_out(dm), ref)


# ---------------- bad input ----------------
def test_bad_inputs(comfy, tmp_path):
    T = training_pkg()
    vae, clip = FakeVAE(), FakeCLIP()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(T.DatasetError, match="holds no images.*Fix"):
        T.encode_dataset(T.DatasetSpec(folder=str(empty)), vae, clip)
    with pytest.raises(T.DatasetError, match="does not exist.*Fix"):
        T.encode_dataset(T.DatasetSpec(folder=str(tmp_path / "nope")), vae, clip)
    bad = make_image_folder(tmp_path / "bad", n=1)
    (bad / "broken.png").write_bytes(b"not an image")
    (bad / "broken.txt").write_text("x")
    with pytest.raises(T.DatasetError, match="broken.png.*cannot be read.*Fix"):
        T.encode_dataset(T.DatasetSpec(folder=str(bad), resolution=64), vae, clip)
    nocap = make_image_folder(tmp_path / "nocap", n=2, captions=False)
    with pytest.raises(T.DatasetError, match="no caption: img0.png, img1.png.*Fix: add a same-name .txt"):
        T.encode_dataset(T.DatasetSpec(folder=str(nocap), resolution=64), vae, clip)
    ok = T.encode_dataset(T.DatasetSpec(folder=str(nocap), resolution=64, caption_for_all="sks dog"), vae, clip)
    assert ok.items[0].caption == "sks dog"

    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    with pytest.raises(ValueError, match="rank must be at least 1.*Fix"):
        T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, rank=0), ds, device="cpu")
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="needs a FLUX model, got .*Sequential.*Fix: load a FLUX"):
        T.FluxLoraTrainer(lin, train_cfg(tmp_path), ds, device="cpu")
    with pytest.raises(ValueError, match="index 5 is out of range.*Fix"):
        T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, double_blocks="0,5"), ds, device="cpu")
    # a failed constructor must leave the model trainable flags as they were
    assert all(p.requires_grad for p in mp.model.diffusion_model.parameters())


def test_block_selection_and_type_ranks(comfy, tmp_path):
    T = training_pkg()
    mp = tiny_flux_patcher()
    net = T.FluxLoraNetwork(mp.model.diffusion_model, T.LoraTargetSpec(rank=4, alpha=2, double_blocks="1",
                                                                        single_blocks="none",
                                                                        type_ranks={"img_mod": 0, "txt_mlp": 8}))
    names = set(net.loras)
    assert "lora_unet_double_blocks_1_img_attn_qkv" in names
    assert not any("double_blocks_0" in n or "single" in n or "img_mod" in n for n in names)
    assert net.loras["lora_unet_double_blocks_1_txt_mlp_0"].rank == 8


def test_loss_plot_image():
    import seedvr2bw.training.plot as P
    img = P.render_loss_curve([1.0, 0.8, 0.9, 0.5, 0.4])
    assert img.shape == (1, 384, 768, 3) and 0 <= float(img.min()) and float(img.max()) <= 1


def test_block_forward_matches_comfyui(comfy):
    from seedvr2bw.training.flux_forward import double_block_forward, single_block_forward
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    g = torch.Generator().manual_seed(3)
    img, txt, vec = torch.randn(1, 16, 64, generator=g), torch.randn(1, 8, 64, generator=g), torch.randn(1, 64, generator=g)
    ids = torch.zeros(1, 24, 3)
    ids[0, 8:, 1] = torch.arange(16) // 4
    ids[0, 8:, 2] = torch.arange(16) % 4
    pe = dm.pe_embedder(ids)
    with torch.no_grad():
        ri, rt = dm.double_blocks[0](img=img.clone(), txt=txt.clone(), vec=vec, pe=pe)
        gi, gt = double_block_forward(dm.double_blocks[0], img, txt, vec, pe, None, {})
        x = torch.cat((txt, img), 1)
        rs = dm.single_blocks[0](x.clone(), vec=vec, pe=pe)
        gs = single_block_forward(dm.single_blocks[0], x, vec, pe, None, {})
    for a, b in ((ri, gi), (rt, gt), (rs, gs)):
        assert float((a - b).norm() / a.norm()) < 1e-6


def test_blockswap_training_matches_resident(comfy, tmp_path):
    """BlockSwap (optimization.blockswap, FakeBackend on CPU): same LoRA as with every block resident."""
    T = training_pkg()
    from seedvr2bw.optimization.blockswap import FakeBackend, PinnedPool
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    ref_w = {k: v.clone() for k, v in dm.state_dict().items()}
    out = []
    for swap in (0, 3):
        kw = {}
        if swap:
            kw = dict(blockswap_backend=FakeBackend(), blockswap_pool=PinnedPool(cap_bytes=1 << 30))
        tr = T.FluxLoraTrainer(dm, train_cfg(tmp_path, steps=4, blocks_to_swap=swap, output_name=f"bs{swap}"), ds,
                               latent_format=mp.model.latent_format, device="cpu", **kw)
        tr.run()
        out.append({k: v.clone() for k, v in tr.network.state_dict().items()})
        if swap:
            assert tr.block_runner.stats()["swapped_bytes"] > 0
        tr.close()
    for k in out[0]:
        assert torch.allclose(out[0][k], out[1][k], atol=1e-6), k
    for k, v in dm.state_dict().items():
        assert torch.equal(v, ref_w[k]), k


def test_rope_function_matches_comfyui_autograd(comfy):
    from comfy.ldm.flux.math import apply_rope1
    from seedvr2bw.training.flux_forward import RopeFn, rope_cos_sin
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    ids = torch.zeros(1, 12, 3)
    ids[0, :, 1] = torch.arange(12) // 4
    ids[0, :, 2] = torch.arange(12) % 4
    pe = dm.pe_embedder(ids)
    x = torch.randn(1, 4, 12, 16, requires_grad=True)
    g = torch.randn(1, 4, 12, 16)
    ref = apply_rope1(x, pe)
    (gr,) = torch.autograd.grad(ref, x, g)
    cos, sin = rope_cos_sin(pe)
    out = RopeFn.apply(x, cos, sin)
    (go,) = torch.autograd.grad(out, x, g)
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(go, gr, atol=1e-5)


def test_fp8_stored_base_used_as_is(comfy, tmp_path):
    """A model ComfyUI loaded in fp8 (weight_dtype fp8_e4m3fn): base_precision=fp8 uses the stored fp8 weights
    (no re-quantization, nothing offloaded) and leaves them untouched."""
    T = training_pkg()
    from seedvr2bw.training.quant import block_linears
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    with torch.no_grad():
        for _, lin in block_linears(dm):
            lin.weight.data = lin.weight.data.to(torch.float8_e4m3fn)
    before = {n: l.weight.data.clone() for n, l in block_linears(dm)}
    tr = T.FluxLoraTrainer(dm, train_cfg(tmp_path, steps=3, base_precision="fp8"), ds,
                           latent_format=mp.model.latent_format, device="cpu")
    assert all(moved is None for _, moved, _ in tr.quant.saved)
    tr.run()
    tr.close()
    assert all(l1 == l2 for l1, l2 in zip(tr.losses, tr.losses)) and all(v == v for v in tr.losses)
    for n, l in block_linears(dm):
        assert l.weight.dtype == torch.float8_e4m3fn and torch.equal(l.weight.data.view(torch.uint8),
                                                                     before[n].view(torch.uint8))


def test_bf16_cast_cache_gradients_match(comfy, tmp_path):
    """LoRA weights cast once per step (shared by forward and checkpoint recompute) give the same gradients."""
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    tr = T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path), ds, latent_format=mp.model.latent_format,
                           device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.network.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    x0 = tr.process_in(ds.latents[0][None]).double()
    cap = ds.items[0].caption
    mp.model.diffusion_model.double()
    grads = []
    for cached in (False, True):
        tr.network.zero_grad(set_to_none=True)
        import contextlib
        cm = tr.network.cast_cache(torch.float64) if cached else contextlib.nullcontext()
        with cm:
            pred = tr.forward(x0 * 0.5, torch.tensor([0.5]), ds.conds[cap][None].double(),
                              ds.pooled[cap][None].double(), 1.0)
            pred.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in tr.network.parameters()]))
    tr.close()
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-9)


def test_block_checkpoint_function_matches_torch_checkpoint(comfy, tmp_path):
    """The per-block checkpoint Function (no_grad forward, recompute + autograd.grad) gives exactly the gradients
    of torch.utils.checkpoint (and of no checkpointing), the first block's LoRA included (its inputs need no grad)."""
    T = training_pkg()
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    tr = T.FluxLoraTrainer(dm, train_cfg(tmp_path), ds, latent_format=mp.model.latent_format, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.network.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    x0 = tr.process_in(ds.latents[0][None])
    cap = ds.items[0].caption
    grads = {}
    for name, ckpt, fast in (("none", False, True), ("torch", True, False), ("fast", True, True)):
        tr.forward.gradient_checkpointing, tr.forward.fast_checkpoint = ckpt, fast
        tr.network.zero_grad(set_to_none=True)
        with tr.network.cast_cache(torch.float32):
            pred = tr.forward(x0 * 0.5, torch.tensor([0.5]), ds.conds[cap][None], ds.pooled[cap][None], 1.0)
            pred.square().mean().backward()
        grads[name] = {k: p.grad.clone() for k, p in tr.network.named_parameters()}
    tr.close()
    first = "loras.lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
    assert grads["fast"][first].abs().sum() > 0
    for k in grads["none"]:
        assert torch.equal(grads["fast"][k], grads["torch"][k]), k
        assert torch.allclose(grads["fast"][k], grads["none"][k], rtol=1e-5, atol=1e-7), k


@pytest.mark.parametrize("mode", ["auto", "fp8"])
def test_lora_forward_installed_and_removed(comfy, tmp_path, mode):
    """LoRA (and the quantized base) run as one per-instance Linear forward; close() leaves no instance attribute,
    no extra submodule/state-dict key and no hook behind."""
    T = training_pkg()
    from seedvr2bw.training.linear_patch import linear_forward
    ds = tiny_dataset(tmp_path)
    mp = tiny_flux_patcher()
    dm = mp.model.diffusion_model
    keys = list(dm.state_dict().keys())
    attrs = {name: set(m.__dict__) for name, m in dm.named_modules()}
    before = _model_out(dm)
    tr = T.FluxLoraTrainer(dm, train_cfg(tmp_path, base_precision=mode), ds, latent_format=mp.model.latent_format,
                           device="cpu")
    assert list(dm.state_dict().keys()) == keys  # the LoRA is not registered as a submodule of the Linear
    for lin in tr.network.targets.values():
        assert lin.forward.__func__ is linear_forward and not lin._forward_hooks
    tr.train_step()
    tr.close()
    assert {name: set(m.__dict__) for name, m in dm.named_modules()} == attrs   # no instance attribute left
    if mode == "auto":
        assert torch.equal(_model_out(dm), before)


def test_recompute_keeps_dequantized_weight_for_backward(comfy, tmp_path, monkeypatch):
    """With checkpointing, an NVFP4 Linear is dequantized in the forward and the recompute only (the backward
    reuses the recompute's weight): 2 per call pair instead of 3, same gradients as dequantizing again."""
    T = training_pkg()
    import seedvr2bw.training.quant as Q
    from seedvr2bw.training.recompute import RecomputeScope
    ds = tiny_dataset(tmp_path)
    results = {}
    for keep in (False, True):
        mp = tiny_flux_patcher()
        tr = T.FluxLoraTrainer(mp.model.diffusion_model, train_cfg(tmp_path, base_precision="nvfp4"), ds,
                               latent_format=mp.model.latent_format, device="cpu")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in tr.network.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        calls = [0]
        real = Q.dequantize_weight

        def counting(t, dtype):
            calls[0] += 1
            return real(t, dtype)
        monkeypatch.setattr(Q, "dequantize_weight", counting)
        if not keep:
            monkeypatch.setattr(Q, "recompute", RecomputeScope())  # one no block recompute enters
        x0 = tr.process_in(ds.latents[0][None])
        cap = ds.items[0].caption
        with tr.network.cast_cache(torch.float32):
            pred = tr.forward(x0 * 0.5, torch.tensor([0.5]), ds.conds[cap][None], ds.pooled[cap][None], 1.0)
            pred.square().mean().backward()
        results[keep] = (calls[0], torch.cat([p.grad.flatten() for p in tr.network.parameters()]))
        monkeypatch.undo()
        tr.close()
    assert results[True][0] < results[False][0]
    assert torch.equal(results[True][1], results[False][1])
