"""FLUX RoPE (adjacent pairs rotated by the position angle) as one Triton kernel, forward and backward.

ComfyUI's ``apply_rope1`` rotates each pair ``(x[2i], x[2i+1])`` in fp32; the backward is the rotation by the
negative angle (``sign=-1``). A direct kernel launch instead of a ``torch.compile``'d function: the first call of
a compiled function made while selective checkpointing's dispatch mode is active is not compiled (Dynamo skips
frames under a dispatch mode), which left a whole first training run on the slow eager RoPE.
"""
from __future__ import annotations

import torch

from ..optimization.nvfp4 import kernels as _K

if _K.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_pairs_kernel(X, C, S, Y, R, HL, L, stride_cb, sign, D: tl.constexpr, BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        m = rows < R
        d = tl.arange(0, D)
        x = tl.load(X + rows[:, None].to(tl.int64) * D + d[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        x0, x1 = tl.split(tl.reshape(x, (BLOCK_R, D // 2, 2)))
        j = tl.arange(0, D // 2)
        off = (rows // HL)[:, None] * stride_cb + (rows % L)[:, None] * (D // 2) + j[None, :]
        c = tl.load(C + off, mask=m[:, None], other=0.0)
        s = tl.load(S + off, mask=m[:, None], other=0.0) * sign
        y = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), (BLOCK_R, D))
        tl.store(Y + rows[:, None].to(tl.int64) * D + d[None, :], y.to(Y.dtype.element_ty), mask=m[:, None])


def usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [B, H, L, D] (D a power of two), cos/sin fp32 [B or 1, 1, L, D/2] on a device Triton runs on."""
    D = x.shape[-1]
    return (_K.triton_usable(x) and x.dim() == 4 and D >= 2 and D & (D - 1) == 0 and cos.dim() == 4
            and cos.dtype == torch.float32 and cos.shape[1] == 1 and tuple(cos.shape[2:]) == (x.shape[2], D // 2)
            and cos.shape[0] in (1, x.shape[0]))


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """``(x0·cos − x1·sin·sign, x0·sin·sign + x1·cos)`` per adjacent pair, in fp32, returned in x's dtype."""
    x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    B, H, L, D = x.shape
    y = torch.empty_like(x)
    R = B * H * L
    if R == 0:
        return y
    block_r = max(1, min(64, 4096 // D))
    _rope_pairs_kernel[(triton.cdiv(R, block_r),)](x, cos, sin, y, R, H * L, L,
                                                   cos.stride(0) if cos.shape[0] > 1 else 0, float(sign),
                                                   D=D, BLOCK_R=block_r, num_warps=4)
    return y
