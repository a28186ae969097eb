"""The smallest FLUX.1 files ComfyUI's own loaders accept, with random weights, for running the training workflow
through ComfyUI's executor on a CPU.

ComfyUI's FLUX detection fixes the width (hidden 3072, 24 heads, T5's 4096-wide context), so the model is made
small in depth instead: 1 double + 1 single block (~0.5 G parameters). T5-XXL (4.7 G parameters) is replaced by a
CLIP-L loaded as ``CLIPLoader(type="sd3")``, whose conditioning ComfyUI pads to 4096 wide with a 2048-wide pooled
vector (CLIP-L's 768 + CLIP-G's 1280 zeros): the model's ``vector_in`` is 2048 wide to take it. The VAE is the
FLUX autoencoder's architecture (16 latent channels). The shapes come from ComfyUI's own classes built on the
meta device, so the files stay in step with the ComfyUI that loads them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

UNET = "tiny_flux1.safetensors"
CLIP_L = "tiny_clip_l.safetensors"
VAE = "tiny_flux_ae.safetensors"


def _random_state_dict(module: torch.nn.Module, seed: int, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in module.state_dict().items():
        if t.ndim >= 2:
            fan_in = t[0].numel()
            v = torch.randn(t.shape, generator=g) * (1.0 / fan_in) ** 0.5
        elif name.endswith(("scale", "norm.weight", "norm1.weight", "norm2.weight", "layer_norm1.weight",
                            "layer_norm2.weight", "final_layer_norm.weight", "norm_out.weight")) or \
                (name.endswith(".weight") and "norm" in name):
            v = torch.ones(t.shape)
        else:
            v = torch.randn(t.shape, generator=g) * 0.02
        out[name] = v.to(dtype).contiguous()
    return out


def _flux_module():
    import comfy.ldm.flux.model
    import comfy.ops
    return comfy.ldm.flux.model.Flux(
        image_model="flux", in_channels=16, out_channels=16, vec_in_dim=2048, context_in_dim=4096, hidden_size=3072,
        mlp_ratio=4.0, num_heads=24, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000,
        patch_size=2, qkv_bias=True, guidance_embed=True, device="meta", operations=comfy.ops.disable_weight_init)


def _clip_l_module():
    import comfy.clip_model
    import comfy.ops
    import comfy.sd1_clip
    cfg = json.loads((Path(comfy.sd1_clip.__file__).parent / "sd1_clip_config.json").read_text())
    return comfy.clip_model.CLIPTextModel(cfg, None, "meta", comfy.ops.disable_weight_init)


def _vae_module():
    import comfy.ldm.modules.diffusionmodules.model as M
    dd = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
          "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    with torch.device("meta"):
        m = torch.nn.Module()
        m.encoder, m.decoder = M.Encoder(**dd), M.Decoder(**dd)
    return m


def write_tiny_flux_files(folder) -> dict[str, Path]:
    """Writes (once) the three files into ``folder``; returns {"unet", "clip_l", "vae"} -> path."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    made = {"unet": (UNET, _flux_module, 1), "clip_l": (CLIP_L, _clip_l_module, 2), "vae": (VAE, _vae_module, 3)}
    paths = {}
    for kind, (name, build, seed) in made.items():
        p = folder / name
        if not p.is_file():
            tmp = p.with_suffix(".tmp")
            save_file(_random_state_dict(build(), seed), str(tmp))
            os.replace(tmp, p)
        paths[kind] = p
    return paths


def write_dataset(folder, n: int = 2, size: int = 256) -> Path:
    """``n`` random images with captions (``sks`` as the trigger word is added by the dataset node)."""
    import numpy as np
    from PIL import Image
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8")).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a photo of thing {i}")
    return folder
