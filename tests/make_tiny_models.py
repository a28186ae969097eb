"""Write tiny SeedVR2 checkpoints in the real file format into a ComfyUI models folder (for tests).

    python tests/make_tiny_models.py <models_dir>          # writes <models_dir>/SEEDVR2/...

Files (all in ``<models_dir>/SEEDVR2``):
  seedvr2_tiny_3b.safetensors, seedvr2_tiny_7b.safetensors  golden tiny DiT weights (official key names)
  ema_vae_tiny.safetensors                                   golden tiny VAE weights; metadata
                                                             ``seedvr2.norm_num_groups = 2`` (the group count
                                                             is the one VAE hyper-parameter no tensor records)
  pos_emb.pt, neg_emb.pt                                     bf16 text embeddings (58, 24) / (64, 24), the
                                                             official shapes with the tiny text dim 24
With ``--flux``: also ``flux_tiny.safetensors`` (a few FLUX-named tensors) for the "wrong model" error tests.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
TINY_TXT_DIM = 24
FILES = {
    "dit_3b": "seedvr2_tiny_3b.safetensors",
    "dit_7b": "seedvr2_tiny_7b.safetensors",
    "vae": "ema_vae_tiny.safetensors",
    "pos": "pos_emb.pt",
    "neg": "neg_emb.pt",
    "flux": "flux_tiny.safetensors",
}


def write_flux_like(path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    save_file({
        "double_blocks.0.img_attn.qkv.weight": torch.randn(48, 16, generator=g),
        "double_blocks.0.txt_attn.qkv.weight": torch.randn(48, 16, generator=g),
        "single_blocks.0.linear1.weight": torch.randn(64, 16, generator=g),
        "img_in.weight": torch.randn(16, 64, generator=g),
        "txt_in.weight": torch.randn(16, 24, generator=g),
    }, str(path))


def make_tiny_models(models_dir, flux: bool = False) -> dict:
    """Returns {kind: path} of what was written (existing identical files are overwritten)."""
    out = Path(models_dir) / "SEEDVR2"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for variant in ("3b", "7b"):
        sd = load_file(str(GOLDEN / f"dit_{variant}_tiny_weights.safetensors"))
        p = out / FILES[f"dit_{variant}"]
        save_file(sd, str(p), metadata={"seedvr2.variant": variant, "seedvr2.tiny": "1"})
        paths[f"dit_{variant}"] = p
    vae = load_file(str(GOLDEN / "vae_tiny_weights.safetensors"))
    p = out / FILES["vae"]
    save_file(vae, str(p), metadata={"seedvr2.norm_num_groups": "2", "seedvr2.tiny": "1"})
    paths["vae"] = p
    g = torch.Generator().manual_seed(2024)
    for kind, length in (("pos", 58), ("neg", 64)):
        p = out / FILES[kind]
        torch.save(torch.randn(length, TINY_TXT_DIM, generator=g).to(torch.bfloat16), str(p))
        paths[kind] = p
    if flux:
        p = out / FILES["flux"]
        write_flux_like(p)
        paths["flux"] = p
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models_dir", help="ComfyUI models folder (the files go into its SEEDVR2 subfolder)")
    ap.add_argument("--flux", action="store_true", help="also write a FLUX-like file for error tests")
    args = ap.parse_args()
    for kind, p in make_tiny_models(args.models_dir, args.flux).items():
        print(f"{kind:7s} {p} ({os.path.getsize(p)} bytes)")


if __name__ == "__main__":
    main()
