"""GPU checks of the FLUX LoRA trainer (run on the device machine; skipped without CUDA)."""
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HERE = Path(__file__).resolve().parent


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_fp8_linear_forward_and_input_grad():
    from seedvr2bw.optimization.runtime.policy import get_policy
    from seedvr2bw.optimization.nvfp4.format import quantize_fp8_per_tensor
    from seedvr2bw.training.quant import FP8LinearFn
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(3072, 3072, device=dev, dtype=torch.bfloat16) / 55
    x = torch.randn(2, 512, 3072, device=dev, dtype=torch.bfloat16, requires_grad=True)
    q, s = quantize_fp8_per_tensor(w)
    tc = get_policy(dev).fp8_gemm
    y = FP8LinearFn.apply(x, q, s, None, tc)
    g = torch.randn_like(y)
    y.backward(g)
    xr = x.detach().float().requires_grad_(True)
    yr = xr @ w.float().t()
    yr.backward(g.float())
    assert _rel(y, yr) < 0.06
    assert _rel(x.grad, xr.grad) < 0.08
    print("fp8 tensorcores:", tc, "fwd rel", _rel(y, yr), "dgrad rel", _rel(x.grad, xr.grad))
    x1 = torch.randn(1, 1, 3072, device=dev, dtype=torch.bfloat16)  # modulation-style M=1 (padded to 16)
    assert _rel(FP8LinearFn.apply(x1, q, s, None, tc), x1.float() @ w.float().t()) < 0.06


def test_nvfp4_roundtrip():
    from seedvr2bw.optimization.nvfp4.format import quantize_nvfp4
    from seedvr2bw.training.quant import dequantize_weight
    w = torch.randn(500, 1024, device="cuda")
    t = quantize_nvfp4(w, return_tensor=True)
    for dtype in (torch.float32, torch.bfloat16):
        r = dequantize_weight(t, dtype)   # Triton kernel when available: same bits as the torch reference
        assert r.shape == w.shape and torch.equal(r, t.dequantize(dtype))
    assert _rel(dequantize_weight(t, torch.float32), w) < 0.12


def _tiny_flux():
    sys.path.insert(0, str(HERE.parent))
    comfy_dir = os.environ.get("COMFYUI_DIR", str(HERE.parents[1] / ".comfy_src"))
    if not os.path.isdir(os.path.join(comfy_dir, "comfy")):
        pytest.skip(f"ComfyUI source not at {comfy_dir}")
    sys.path.insert(0, comfy_dir)
    sys.path.insert(0, str(HERE.parents[1] / "scripts"))
    import bench_flux_lora as B
    B.setup_comfy(comfy_dir, cpu=False)
    return B


def test_tiny_flux_trains_on_cuda(tmp_path):
    B = _tiny_flux()
    mp = B.build_model(B.TINY, torch.device("cuda"), torch.bfloat16)
    from seedvr2bw.training.trainer import FluxLoraTrainer, TrainConfig
    ds = B.make_dataset(64, B.TINY)
    for mode in ("bf16", "fp8", "nvfp4"):
        cfg = TrainConfig(rank=4, alpha=4, steps=30, learning_rate=3e-3, output_dir=str(tmp_path),
                          output_name=f"t_{mode}", base_precision="auto" if mode == "bf16" else mode)
        tr = FluxLoraTrainer(mp.model.diffusion_model, cfg, ds, latent_format=mp.model.latent_format, device="cuda")
        tr.run()
        tr.close()
        first, last = sum(tr.losses[:5]) / 5, sum(tr.losses[-5:]) / 5
        print(mode, first, last)
        assert all(l == l for l in tr.losses)
        assert last < first


def _train_and_collect(tr, steps, check=None):
    """``steps`` training steps, then (losses, LoRA weights on the CPU); ``check(tr)`` runs before closing."""
    try:
        for _ in range(steps):
            tr.train_step()
        if check is not None:
            check(tr)
        return list(tr.losses), {k: v.detach().float().cpu().clone() for k, v in tr.network.state_dict().items()}
    finally:
        tr.close()


def _same_training(a, b, loss_rtol, weight_rel, label):
    (l_a, w_a), (l_b, w_b) = a, b
    assert torch.allclose(torch.tensor(l_a), torch.tensor(l_b), rtol=loss_rtol, atol=1e-4), (l_a, l_b)
    worst = max(_rel(w_a[k], w_b[k]) for k in w_b if w_b[k].norm() > 0)
    print(label, "losses", l_a[-3:], l_b[-3:], "worst LoRA rel diff", worst)
    assert worst < weight_rel


@pytest.mark.parametrize("mode", ["bf16", "fp8", "nvfp4"])
def test_cuda_graph_step_matches_eager(tmp_path, mode):
    """The graphed step (captured once per shape, replayed after) trains like the eager step: same losses and
    LoRA weights after several steps, with two latent sizes (two graphs sharing one memory pool)."""
    B = _tiny_flux()
    from seedvr2bw.training.data import EncodedDataset, Item
    from seedvr2bw.training.trainer import FluxLoraTrainer, TrainConfig
    mp = B.build_model(B.TINY, torch.device("cuda"), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    cap = "a photo of sks"
    items = [Item("a", cap, (64, 64), "0", None), Item("b", cap, (64, 96), "1", None)]
    lats = [torch.randn(16, 8, 8, generator=g), torch.randn(16, 8, 12, generator=g)]
    ds = EncodedDataset(items, lats, {cap: torch.randn(256, B.TINY["context_in_dim"], generator=g)},
                        {cap: torch.randn(B.TINY["vec_in_dim"], generator=g)})
    runs = {}
    for graph in ("off", "on"):
        cfg = TrainConfig(rank=4, alpha=4, steps=8, learning_rate=3e-3, output_dir=str(tmp_path), seed=3,
                          output_name=f"g_{graph}", base_precision="auto" if mode == "bf16" else mode,
                          cuda_graph=graph, grad_accum=2 if mode == "bf16" else 1, compile_blocks="off")
        tr = FluxLoraTrainer(mp.model.diffusion_model, cfg, ds, latent_format=mp.model.latent_format, device="cuda")

        def check(tr, graph=graph):
            if graph == "on":
                assert tr.graphed is not None and tr.graphed.failed is None, tr.graphed and tr.graphed.failed
                assert len(tr.graphed.graphs) == 2   # both bucket shapes were captured and replayed
        runs[graph] = _train_and_collect(tr, cfg.steps, check)
    _same_training(runs["on"], runs["off"], 2e-2, 2e-2, f"{mode} graphed vs eager:")


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_selective_checkpointing_matches_full_on_cuda(tmp_path, mode, monkeypatch):
    """Graphed steps with selective checkpointing (GEMM/attention outputs kept) train like full per-block
    checkpointing: same losses and LoRA weights after several steps."""
    import seedvr2bw.training.selective_checkpoint as sc
    monkeypatch.setattr(sc, "MIN_SAVED_K", 16)   # the tiny model's K is below the real threshold
    B = _tiny_flux()
    from seedvr2bw.training.trainer import FluxLoraTrainer, TrainConfig
    mp = B.build_model(B.TINY, torch.device("cuda"), torch.bfloat16)
    ds = B.make_dataset(64, B.TINY)
    runs = {}
    for sel in ("off", "on"):
        cfg = TrainConfig(rank=4, alpha=4, steps=6, learning_rate=3e-3, output_dir=str(tmp_path), seed=3,
                          output_name=f"s_{sel}", base_precision="auto" if mode == "bf16" else mode,
                          selective_checkpointing=sel)
        tr = FluxLoraTrainer(mp.model.diffusion_model, cfg, ds, latent_format=mp.model.latent_format, device="cuda")

        def check(tr, sel=sel):
            n = len(tr.dm.double_blocks) + len(tr.dm.single_blocks)
            assert list(tr.forward.selective_by_shape.values()) == ([n] if sel == "on" else [])
            assert tr.graphed is not None and tr.graphed.failed is None
        runs[sel] = _train_and_collect(tr, cfg.steps, check)
    _same_training(runs["on"], runs["off"], 1e-2, 1e-2, f"{mode} selective vs full:")


@pytest.mark.parametrize("mode", ["bf16", "fp8", "nvfp4", "blockswap"])
def test_training_under_inference_mode_matches_normal_tensors(tmp_path, mode):
    """ComfyUI builds its models and runs every node inside torch.inference_mode(): the same training from a model
    of inference tensors, started under inference mode, equals the one from a model of normal tensors (CUDA graphs,
    the fp8/NVFP4 base and BlockSwap included), and the model is handed back as inference tensors."""
    B = _tiny_flux()
    from seedvr2bw.training.trainer import FluxLoraTrainer, TrainConfig
    ds = B.make_dataset(64, B.TINY)
    runs = {}
    for inference in (False, True):
        torch.manual_seed(0)
        with torch.inference_mode(inference):
            mp = B.build_model(B.TINY, torch.device("cuda"), torch.bfloat16)
        dm = mp.model.diffusion_model
        assert all(p.is_inference() == inference for p in dm.parameters())
        cfg = TrainConfig(rank=4, alpha=4, steps=6, learning_rate=3e-3, output_dir=str(tmp_path), seed=3,
                          output_name=f"inf_{mode}_{inference}",
                          base_precision=mode if mode in ("fp8", "nvfp4") else "auto",
                          blocks_to_swap=2 if mode == "blockswap" else 0)
        with torch.inference_mode(inference):
            tr = FluxLoraTrainer(dm, cfg, ds, latent_format=mp.model.latent_format, device="cuda")
            runs[inference] = _train_and_collect(tr, cfg.steps)
        assert all(p.is_inference() == inference and p.device.type == "cuda" for p in dm.parameters())
    _same_training(runs[True], runs[False], 1e-3, 1e-3, f"{mode} inference-mode model vs normal:")
