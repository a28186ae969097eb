"""Rotary position embeddings of the two SeedVR2 variants (docs/SPEC.md §2), in plain torch.

Both follow rotary-embedding-torch 0.5.3 (the version the official code pins), re-implemented here:
* angles of the three axes are concatenated in (t, h, w) order, each angle repeated for an adjacent
  pair: (a0, a0, a1, a1, ...);
* a pair (x_2j, x_2j+1) becomes (x_2j cos - x_2j+1 sin, x_2j+1 cos + x_2j sin);
* only the leading ``rotated`` features of each head are touched; RoPE runs in fp32.

3B "mmrope3d": ``lang`` frequencies theta^(-2j/d), d = rope_dim // 3; a video token at window-local
(i_t, i_h, i_w) sits at (L_txt + i_t, i_h, i_w); text token k at (k, k, k). Text is rotated too.
7B axial "pixel" RoPE: frequencies pi * linspace(1, max_freq/2, d/2); positions along an axis with n
tokens in the window are linspace(-1, 1, n). Video only.

The frequency vectors are checkpoint buffers ``blocks.N.attn.rope.rope.freqs``; they are constants.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


def lang_freqs(axis_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, axis_dim, 2)[: axis_dim // 2].float() / axis_dim))


def pixel_freqs(axis_dim: int, max_freq: float = 256.0) -> torch.Tensor:
    return torch.linspace(1.0, max_freq / 2, axis_dim // 2) * math.pi


class _Freqs(nn.Module):
    """Holds the ``freqs`` buffer (checkpoint key ``...rope.rope.freqs``)."""

    def __init__(self, freqs: torch.Tensor):
        super().__init__()
        self.register_buffer("freqs", freqs)


class RoPE3d(nn.Module):
    """Per-block RoPE holder. ``kind``: ``mmrope3d`` (3B) or ``pixel`` (7B). The tables themselves are
    built once per input shape by the model (see :func:`video_angles`), not per block."""

    def __init__(self, kind: str, dim: int, device=None):
        super().__init__()
        self.kind = kind
        axis_dim = dim // 3
        freqs = lang_freqs(axis_dim) if kind == "mmrope3d" else pixel_freqs(axis_dim)
        self.rope = _Freqs(freqs.to(device) if device is not None else freqs)

    @property
    def freqs(self) -> torch.Tensor:
        return self.rope.freqs


def _pair_repeat(a: torch.Tensor) -> torch.Tensor:
    """(..., 3, F) per-axis angles -> (..., 6F) in the library's order: axis-major, each angle twice."""
    return a.repeat_interleave(2, dim=-1).flatten(-2)


def _linspace_table(n_max: int) -> torch.Tensor:
    """table[n, i] = torch.linspace(-1, 1, n)[i] (exactly what the library evaluates), n = 1..n_max."""
    table = torch.zeros(n_max + 1, max(n_max, 1))
    for n in range(1, n_max + 1):
        table[n, :n] = torch.linspace(-1, 1, steps=n)
    return table


def video_angles(kind: str, freqs: torch.Tensor, coords: torch.Tensor, sizes: torch.Tensor, txt_offset: torch.Tensor) -> torch.Tensor:
    """(N, 6F) rotation angles of video tokens from their window-local coordinates (fp32, CPU)."""
    freqs = freqs.detach().float().cpu()
    if kind == "mmrope3d":
        pos = coords.clone()
        pos[:, 0] += txt_offset  # temporal axis shifted past the text positions
        pos = pos.float()
    else:
        table = _linspace_table(int(sizes.max()) if sizes.numel() else 1)
        pos = table[sizes, coords]  # normalised coordinates within the window
    return _pair_repeat(pos[:, :, None] * freqs[None, None, :])


def text_angles(freqs: torch.Tensor, length: int) -> torch.Tensor:
    """3B text: position k on all three axes -> (L, 6F)."""
    freqs = freqs.detach().float().cpu()
    a = torch.arange(length).float()[:, None] * freqs[None, :]  # (L, F)
    return _pair_repeat(a[:, None, :].expand(length, 3, a.shape[-1]))


@dataclass
class RopeTable:
    """Per-token RoPE table. ``cos``/``sin`` (N, R) fp32 in the library layout (each angle twice) for the
    exact fp32 path; ``cis`` (N, R/2) complex64 = exp(i*angle), one entry per rotated pair, for the
    half-precision path (one complex multiply instead of the rotate-half expression)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cis: torch.Tensor
    cos_pair: Optional[torch.Tensor] = None  # (N, R/2) fp32, one entry per pair (fused kernels)
    sin_pair: Optional[torch.Tensor] = None

    @property
    def rotated(self) -> int:
        return self.cos.shape[-1]


def make_rope_table(angles: torch.Tensor, device) -> RopeTable:
    per_pair = angles[:, 0::2]
    return RopeTable(angles.cos().to(device), angles.sin().to(device),
                     torch.polar(torch.ones_like(per_pair), per_pair).to(device),
                     per_pair.cos().contiguous().to(device), per_pair.sin().contiguous().to(device))


def apply_rope(x: torch.Tensor, table: RopeTable, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate the leading ``table.rotated`` features of x (N, H, D), in fp32, result in x's dtype
    (written into ``out`` when given; ``out`` may be a strided view, e.g. the q slot of a qkv tensor)."""
    r = table.rotated
    if x.dtype in (torch.float32, torch.float64):
        # the library's expression: x*cos + rotate_half(x)*sin, rotate_half(x0, x1) = (-x1, x0)
        head, tail = x[..., :r], x[..., r:]
        pairs = head.unflatten(-1, (r // 2, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        y = torch.cat((head * table.cos[:, None, :] + rotated * table.sin[:, None, :], tail), dim=-1)
        return y if out is None else out.copy_(y)
    # (x0 + i x1) * (cos + i sin) = (x0 cos - x1 sin) + i (x1 cos + x0 sin): the same pair rotation
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xc = torch.view_as_complex(x[..., :r].float().unflatten(-1, (r // 2, 2)))
    out[..., :r] = torch.view_as_real(xc * table.cis[:, None, :]).flatten(-2)
    out[..., r:] = x[..., r:]
    return out
