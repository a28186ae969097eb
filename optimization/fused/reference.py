"""Pure-torch references of the fused ops (fp32 math, result in the input dtype).

They define what each Triton kernel computes; the self-test and the CPU tests compare against them.
(The model's own exact fp32/CPU path stays in ``models/seedvr2/dit``; these are not used there.)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def _rows(v: torch.Tensor, sid: Optional[torch.Tensor]) -> torch.Tensor:
    return v if sid is None else v[sid.long()]


def norm_modulate(x, scale, shift, eps, sid=None):
    xf = x.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * r * _rows(scale, sid) + _rows(shift, sid)).to(x.dtype)


def residual_norm_modulate(res, o, gate, scale, shift, eps, sid=None) -> Tuple[torch.Tensor, torch.Tensor]:
    x = gated_residual(res, o, gate, sid)
    return x, norm_modulate(x, scale, shift, eps, sid)


def gated_residual(res, x, gate, sid=None):
    return (res.float() + x.float() * _rows(gate, sid)).to(res.dtype)


def qk_norm_rope(x, weight, eps, cos=None, sin=None):
    """x (N, H, D); cos/sin (N, R/2) per pair. Norm (stored in x's dtype), then pair rotation."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype).float()
    if cos is not None:
        r2 = cos.shape[1]
        p = y[..., : 2 * r2].unflatten(-1, (r2, 2))
        e, o = p[..., 0], p[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]
        y = torch.cat((torch.stack((e * c - o * s, o * c + e * s), -1).flatten(-2), y[..., 2 * r2:]), -1)
    return y.to(x.dtype)


def qkv_norm_rope_pack(qkv, heads, head_dim, wq, wk, eps, cos, sin, dst, q, k, v, src=None):
    t = qkv.view(qkv.shape[0], 3, heads, head_dim)
    if src is not None:
        t = t[src.long()]
        cos = cos[src.long()] if cos is not None else None
        sin = sin[src.long()] if sin is not None else None
    dst = dst.long()
    q.index_copy_(0, dst, qk_norm_rope(t[:, 0], wq, eps, cos, sin))
    k.index_copy_(0, dst, qk_norm_rope(t[:, 1], wk, eps, cos, sin))
    v.index_copy_(0, dst, t[:, 2])


def silu_mul(a, b):
    return (torch.nn.functional.silu(a.float()).to(a.dtype).float() * b.float()).to(a.dtype)


def group_norm_frames(x, groups, weight, bias, eps, silu=False):
    """Per-frame GroupNorm of x (B, C, T, H, W) [+ SiLU], as the VAE's torch path computes it."""
    b, c, t, h, w = x.shape
    y = torch.nn.functional.group_norm(x.transpose(1, 2).reshape(b * t, c, h, w), groups, weight, bias, eps)
    y = y.to(x.dtype)
    if silu:
        y = torch.nn.functional.silu(y)
    return y.view(b, t, c, h, w).transpose(1, 2).contiguous()


def merge_moments(part, cnt, n=None):
    """(mean, M2) over the blocks of each row of ``part`` (rows, blocks, 2: each block's mean and M2) with ``cnt``
    values per block (blocks,) and ``n`` in all (default: their sum) (Chan et al.), in float32."""
    means, m2s = part[..., 0], part[..., 1]
    mean = (means * cnt).sum(1) / (cnt.sum() if n is None else n)
    m2 = m2s.sum(1) + (cnt * (means - mean[:, None]).square()).sum(1)
    return mean, m2
