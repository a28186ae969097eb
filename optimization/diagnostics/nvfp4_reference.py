"""An independent NVFP4 reference (CPU, float32), written from the format's definition rather than from the
library, so the diagnostic does not check the library against itself.

Recipe (comfy-kitchen's, the pack's default): g = amax/(6*448); per 16-block s = e4m3(min((amax_b/6)/g, 448));
elements x/(g*s) saturated to +-6 and rounded to the nearest E2M1 value, ties to the even code; an all-zero block
(s == 0) decodes to zeros. Decode: value * s * g.
"""
from __future__ import annotations

import torch

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nearest_e2m1(a: torch.Tensor) -> torch.Tensor:
    """|x| (already saturated to <= 6) -> magnitude code 0..7, nearest value, ties to the even code."""
    dist = (a.unsqueeze(-1) - GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    cand = dist == best
    even = torch.zeros(8, dtype=torch.bool)
    even[0::2] = True
    pick_even = cand & even
    has_even = pick_even.any(dim=-1)
    return torch.where(has_even, pick_even.float().argmax(dim=-1), cand.float().argmax(dim=-1))


def reference_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize + decode of a 2-D float tensor (K % 16 == 0), float32 result, same shape."""
    w = w.detach().float().cpu()
    rows, cols = w.shape
    amax = w.abs().max()
    g = amax / (6.0 * 448.0) if amax > 0 else torch.tensor(1.0)
    xb = w.reshape(rows, cols // 16, 16)
    s = ((xb.abs().amax(dim=-1) / 6.0) / g).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    total = g * s
    safe = torch.where(total == 0, torch.ones_like(total), total)
    d = (xb / safe.unsqueeze(-1)).clamp(-6.0, 6.0)
    mag = GRID[nearest_e2m1(d.abs())]
    vals = torch.where(d < 0, -mag, mag)
    out = vals * total.unsqueeze(-1)
    out = torch.where((total == 0).unsqueeze(-1), torch.zeros_like(out), out)
    return out.reshape(rows, cols)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.float(), y.float()
    noise = (x - y).pow(2).mean().item()
    return float("inf") if noise == 0 else 10 * torch.log10(x.pow(2).mean() / noise).item()
