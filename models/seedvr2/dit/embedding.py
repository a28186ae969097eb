"""Input/output embeddings of the DiT: timestep embedding, 1x2x2 patch in, patch out (docs/SPEC.md §1.1, §1.2)."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch import nn


def sinusoidal_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """diffusers ``get_timestep_embedding`` with flip_sin_to_cos=False, downscale_freq_shift=0, scale 1:
    [sin(t f_k), cos(t f_k)], f_k = exp(-ln(max_period) k / (dim/2)). t on the raw 0..1000 scale.
    Computed in fp32 in the same operation order, so fp32 results match bit for bit."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device)
    exponent = exponent / half
    freqs = torch.exp(exponent)
    angles = t[:, None].float() * freqs[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


class TimeEmbedding(nn.Module):
    """sinusoid(256) -> Linear -> SiLU -> Linear -> SiLU -> Linear(6*dim): one vector per sample."""

    def __init__(self, sinusoidal_dim: int, hidden_dim: int, output_dim: int, device=None, dtype=None):
        super().__init__()
        self.sinusoidal_dim = sinusoidal_dim
        self.proj_in = nn.Linear(sinusoidal_dim, hidden_dim, device=device, dtype=dtype)
        self.proj_hid = nn.Linear(hidden_dim, hidden_dim, device=device, dtype=dtype)
        self.proj_out = nn.Linear(hidden_dim, output_dim, device=device, dtype=dtype)
        self.act = nn.SiLU()

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        emb = sinusoidal_embedding(timestep, self.sinusoidal_dim).to(dtype)
        emb = self.act(self.proj_in(emb))
        emb = self.act(self.proj_hid(emb))
        return self.proj_out(emb)


class PatchIn(nn.Module):
    """Packed latent tokens (sum T*H*W, C) -> patch tokens (sum T*(H/2)*(W/2), dim).

    The feature vector of one 1x2x2 patch is ordered (pt, ph, pw, c) with c fastest, then one Linear.
    """

    def __init__(self, in_channels: int, patch_size: Sequence[int], dim: int, device=None, dtype=None):
        super().__init__()
        self.patch_size = tuple(patch_size)
        pt, ph, pw = self.patch_size
        self.proj = nn.Linear(in_channels * pt * ph * pw, dim, device=device, dtype=dtype)

    def patchify(self, vid: torch.Tensor, shapes: List[Tuple[int, int, int]]) -> torch.Tensor:
        pt, ph, pw = self.patch_size
        out = []
        for x, (t, h, w) in zip(vid.split([t * h * w for t, h, w in shapes]), shapes):
            c = x.shape[-1]
            x = x.reshape(t // pt, pt, h // ph, ph, w // pw, pw, c)
            x = x.permute(0, 2, 4, 1, 3, 5, 6)  # T H W pt ph pw c
            out.append(x.reshape(-1, pt * ph * pw * c))
        return out[0] if len(out) == 1 else torch.cat(out)

    def forward(self, vid: torch.Tensor, shapes: List[Tuple[int, int, int]]) -> torch.Tensor:
        return self.proj(self.patchify(vid, shapes))


class PatchOut(nn.Module):
    """Patch tokens (sum T*(H/2)*(W/2), dim) -> Linear -> packed latent tokens (sum T*H*W, C)."""

    def __init__(self, out_channels: int, patch_size: Sequence[int], dim: int, device=None, dtype=None):
        super().__init__()
        self.patch_size = tuple(patch_size)
        pt, ph, pw = self.patch_size
        self.proj = nn.Linear(dim, out_channels * pt * ph * pw, device=device, dtype=dtype)

    def unpatchify(self, x: torch.Tensor, grid: List[Tuple[int, int, int]]) -> torch.Tensor:
        pt, ph, pw = self.patch_size
        out = []
        for y, (t, h, w) in zip(x.split([t * h * w for t, h, w in grid]), grid):
            c = y.shape[-1] // (pt * ph * pw)
            y = y.reshape(t, h, w, pt, ph, pw, c).permute(0, 3, 1, 4, 2, 5, 6)  # T pt H ph W pw c
            out.append(y.reshape(-1, c))
        return out[0] if len(out) == 1 else torch.cat(out)

    def forward(self, x: torch.Tensor, grid: List[Tuple[int, int, int]]) -> torch.Tensor:
        return self.unpatchify(self.proj(x), grid)
