"""Shared helpers for the FLUX LoRA training tests (tiny FLUX from ComfyUI's own class, fake encoders)."""
from pathlib import Path

import torch

from comfy_env import require_comfy  # noqa: E402,F401  (re-exported for the training tests)


TINY = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=48, hidden_size=64,
            mlp_ratio=4.0, num_heads=4, depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
            patch_size=2, qkv_bias=True, guidance_embed=True)


def tiny_flux_patcher(seed=0, dtype=torch.float32):
    """A ComfyUI ModelPatcher holding comfy.model_base.Flux with a tiny comfy.ldm.flux.model.Flux inside."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models
    mc = comfy.supported_models.Flux(dict(TINY))
    mc.set_inference_dtype(dtype, None)
    m = comfy.model_base.Flux(mc, device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.diffusion_model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[1]) ** 0.5)
            elif name.endswith("scale"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    m.eval()
    return comfy.model_patcher.ModelPatcher(m, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


class FakeVAE:
    """Duck-types comfy.sd.VAE.encode/decode: 8x down-sampling to 16 channels (a fixed random projection)."""
    cache_fingerprint = "fake-vae-1"

    def __init__(self):
        g = torch.Generator().manual_seed(123)
        self.proj = torch.randn(3 * 64, 16, generator=g) / 8.0
        self.calls = 0

    def encode(self, pixels):  # [B,H,W,3] -> [B,16,H/8,W/8]
        self.calls += 1
        B, H, W, _ = pixels.shape
        x = pixels.reshape(B, H // 8, 8, W // 8, 8, 3).permute(0, 1, 3, 2, 4, 5).reshape(B, H // 8, W // 8, -1)
        return (x @ self.proj).permute(0, 3, 1, 2).contiguous()

    def decode(self, lat):  # [B,16,h,w] -> [B,8h,8w,3]
        B, C, h, w = lat.shape
        return torch.sigmoid(lat.mean(1, keepdim=True)).repeat_interleave(8, 2).repeat_interleave(8, 3) \
            .permute(0, 2, 3, 1).repeat(1, 1, 1, 3)


class FakeCLIP:
    """Duck-types comfy.sd.CLIP.tokenize/encode_from_tokens (hash-seeded embeddings, 8 tokens)."""
    cache_fingerprint = "fake-clip-1"

    def __init__(self, dim=48, pooled=32):
        self.dim, self.pooled_dim, self.calls = dim, pooled, 0

    def tokenize(self, text):
        return text

    def encode_from_tokens(self, tokens, return_pooled=False):
        self.calls += 1
        import hashlib
        seed = int(hashlib.sha256(tokens.encode()).hexdigest()[:8], 16)
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn(1, 8, self.dim, generator=g)
        pooled = torch.randn(1, self.pooled_dim, generator=g)
        return (cond, pooled) if return_pooled else cond


def make_image_folder(folder: Path, n=2, size=(64, 64), captions=True):
    from PIL import Image
    import numpy as np
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        arr = (rng.random((size[1], size[0], 3)) * 255).astype("uint8")
        Image.fromarray(arr).save(folder / f"img{i}.png")
        if captions:
            (folder / f"img{i}.txt").write_text(f"a photo of thing{i}")
    return folder
