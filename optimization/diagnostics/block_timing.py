"""Measured compute time of one SeedVR2 DiT block: the pack's own NaDiT with random bf16 weights, run with 2 and
with 4 blocks on the same input; the difference over 2 blocks is the time of one (unshifted + shifted) block,
embeddings and output head cancel out."""
from __future__ import annotations

import dataclasses
import math

import torch

from .timing import cuda_ms, wall_ms

TXT_LEN = 58
RESOLUTIONS = {"720p": (720, 1280), "1080p": (1080, 1920)}


def latent_grid(height: int, width: int, frames: int) -> tuple:
    """(T, H, W) of the VAE latent: 4n+1 frames -> n+1 latent frames, sizes padded to 16 then /8."""
    n = math.ceil((frames - 1) / 4) if frames > 1 else 0
    return n + 1, math.ceil(height / 16) * 16 // 8, math.ceil(width / 16) * 16 // 8


def random_dit(cfg, num_layers: int, device, dtype=torch.bfloat16, attention="auto"):
    from ...models.seedvr2.dit import NaDiT
    small = dataclasses.replace(cfg, num_layers=num_layers, window_methods=None, mm_layers=None)
    model = NaDiT(small, attention_backend=attention, device=device, dtype=dtype).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]), generator=gen)
            elif "norm" in name or name.endswith("_scale"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    return model


def _inputs(cfg, grid, device, dtype):
    t, h, w = grid
    vid = torch.randn(t * h * w, cfg.vid_in_channels, device=device, dtype=dtype)
    txt = torch.randn(TXT_LEN, cfg.txt_in_dim, device=device, dtype=dtype)
    return (vid, txt, torch.tensor([[t, h, w]], device=device), torch.tensor([[TXT_LEN]], device=device),
            torch.tensor([1000.0], device=device))


def measure_block_ms(cfg, cases, device, reps: int = 5, dtype=torch.bfloat16, attention="auto") -> dict:
    """{label: ms per block} for ``cases`` = [(label, height, width, frames)]; a case that fails (e.g. out of
    memory) maps to the exception text instead."""
    device = torch.device(device)
    timer = (lambda fn: cuda_ms(fn, reps=reps, warmup=1)) if device.type == "cuda" else \
        (lambda fn: wall_ms(fn, reps=reps, warmup=1, sync=False))
    models = {n: random_dit(cfg, n, device, dtype, attention) for n in (2, 4)}
    out = {}
    try:
        for label, height, width, frames in cases:
            try:
                args = _inputs(cfg, latent_grid(height, width, frames), device, dtype)
                with torch.no_grad():
                    times = {n: timer(lambda m=m: m(*args)) for n, m in models.items()}
                out[label] = max(1e-6, (times[4] - times[2]) / 2)
                del args
            except torch.cuda.OutOfMemoryError as exc:
                out[label] = f"out of memory: {str(exc).splitlines()[0][:120]}"
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                out[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        del models
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
