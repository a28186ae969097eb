"""Adaptive modulation "ada: single" (docs/SPEC.md §1.5).

The shared time embedding e (6*dim per sample) is *interleaved*: for feature d, layer l (0 attn,
1 mlp) and kind k (0 shift, 1 scale, 2 gate) the entry is e[d*6 + l*3 + k]. Each block/stream adds its
own learnable vectors: in = x*(e_scale + p_scale) + (e_shift + p_shift) (scale used directly, not 1+s);
out (gate) = x*(e_gate + p_gate).

The sums and products run in fp32 and the result is cast back to the stream dtype: the official
module adds bf16 embeddings to fp32 parameters (fp32 result) under autocast.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ....optimization import fused
from .norm import rms_norm

LAYERS = ("attn", "mlp")


class AdaSingle(nn.Module):
    """Per-block learnable parts: ``{attn,mlp}_{shift,scale,gate}`` (checkpoint names)."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        for layer in LAYERS:
            self.register_parameter(f"{layer}_shift", nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)))
            self.register_parameter(f"{layer}_scale", nn.Parameter(torch.ones(dim, device=device, dtype=dtype)))
            self.register_parameter(f"{layer}_gate", nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)))


class OutAda(nn.Module):
    """3B output head modulation: ``out_shift``, ``out_scale`` (mode "in" only)."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.out_shift = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.out_scale = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))


def split_embedding(emb: torch.Tensor, num_layers: int = 2) -> torch.Tensor:
    """(B, 6*dim) -> (B, dim, layers, 3) view of the interleaved embedding."""
    b, n = emb.shape
    return emb.view(b, n // (3 * num_layers), num_layers, 3)


def _per_token(e: torch.Tensor, lens: Optional[List[int]]) -> torch.Tensor:
    """(B, dim) -> broadcastable over the packed tokens of B samples."""
    if e.shape[0] == 1:
        return e  # (1, dim) broadcasts over all tokens
    return torch.repeat_interleave(e, torch.tensor(lens, device=e.device), dim=0, output_size=sum(lens))


def _exact(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float32, torch.float64)


def modulate_in(x, e: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, lens) -> torch.Tensor:
    """x*(e_scale + scale) + (e_shift + shift); ``e`` is the (B, dim, 3) slot of one layer."""
    e = e.float()
    s = _per_token(e[..., 1] + scale.float(), lens)
    b = _per_token(e[..., 0] + shift.float(), lens)
    if _exact(x):
        return x * s.to(x.dtype) + b.to(x.dtype)  # the reference's order: mul, then add
    # half precision: one fused pass, computed in fp32, stored in the stream dtype
    return torch.addcmul(b, x, s, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


def gated_residual(res: torch.Tensor, x: torch.Tensor, e: torch.Tensor, gate: torch.Tensor, lens) -> torch.Tensor:
    """res + x*(e_gate + gate): the "out" modulation followed by the residual add."""
    g = _per_token(e.float()[..., 2] + gate.float(), lens)
    if _exact(x):
        return res + x * g.to(x.dtype)
    return torch.addcmul(res, x, g, out=torch.empty(res.shape, dtype=res.dtype, device=res.device))


# ---- fused entry points: one Triton pass on CUDA half tensors, else exactly the torch code above ----
def _vec(e: torch.Tensor, kind: int, p: torch.Tensor) -> torch.Tensor:
    """(B, dim) fp32 e[..., kind] + p (the per-sample shift/scale/gate)."""
    return e.float()[..., kind] + p.float()


def norm_modulate_in(x: torch.Tensor, e: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, lens,
                     eps: float) -> torch.Tensor:
    """modulate_in(rms_norm(x)): RMSNorm without weight (fp32 statistics), then the "in" modulation."""
    if fused.enabled(x):
        return fused.norm_modulate(x, _vec(e, 1, scale), _vec(e, 0, shift), eps, lens)
    return modulate_in(rms_norm(x, None, eps), e, shift, scale, lens)


def gated_residual_norm_modulate(res: torch.Tensor, x: torch.Tensor, e_out: torch.Tensor, gate: torch.Tensor,
                                 e_in: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, lens, eps: float):
    """r = gated_residual(res, x, e_out, gate); returns (r, norm_modulate_in(r, e_in, shift, scale))."""
    if fused.enabled(res, x):
        return fused.residual_norm_modulate(res, x, _vec(e_out, 2, gate), _vec(e_in, 1, scale),
                                            _vec(e_in, 0, shift), eps, lens)
    r = gated_residual(res, x, e_out, gate, lens)
    return r, modulate_in(rms_norm(r, None, eps), e_in, shift, scale, lens)


def gated_residual_fused(res: torch.Tensor, x: torch.Tensor, e: torch.Tensor, gate: torch.Tensor, lens) -> torch.Tensor:
    """:func:`gated_residual`, one Triton pass on CUDA half tensors (no per-token gate copy for B > 1)."""
    if fused.enabled(res, x):
        return fused.gated_residual(res, x, _vec(e, 2, gate), lens)
    return gated_residual(res, x, e, gate, lens)
