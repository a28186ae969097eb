"""Triton kernels of the DiT's fused elementwise chains (imported only when Triton is present; the VAE's are in
``vae_kernels``).

All arithmetic is fp32; inputs/outputs are in the stream dtype (bf16/fp16). Every kernel reads each
input once and writes each output once (see ``__init__`` for the byte counts).
"""

import torch
import triton
import triton.language as tl



# --------------------------------------------------------------------------------------------------
# (a) [gated residual +] RMSNorm (fp32 statistics, no weight) + modulation, one row per program
# --------------------------------------------------------------------------------------------------
@triton.jit
def norm_mod_kernel(X, O, G, XOUT, Y, S, B, SID, D, eps,
                     HAS_RES: tl.constexpr, HAS_SID: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    sid = 0
    if HAS_SID:
        sid = tl.load(SID + row).to(tl.int64)
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        o = tl.load(O + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + sid * D + cols, mask=mask, other=0.0)
        xr = (x + o * g).to(XOUT.dtype.element_ty)  # the residual stream is stored in its dtype
        tl.store(XOUT + row * D + cols, xr, mask=mask)
        x = xr.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    s = tl.load(S + sid * D + cols, mask=mask, other=0.0)
    b = tl.load(B + sid * D + cols, mask=mask, other=0.0)
    tl.store(Y + row * D + cols, (x * r * s + b).to(Y.dtype.element_ty), mask=mask)


def norm_modulate(x, s, b, eps, sid=None, res_o=None, res_g=None):
    """y = rms(x') * s[sid] + b[sid] with x' = x (or x + res_o * res_g[sid]); returns (x', y)."""
    n, d = x.shape
    y = torch.empty_like(x)
    has_res = res_o is not None
    xout = torch.empty_like(x) if has_res else x
    if n:
        norm_mod_kernel[(n,)](
            x, res_o if has_res else x, res_g if has_res else s, xout, y, s, b,
            sid if sid is not None else s, d, float(eps),
            HAS_RES=has_res, HAS_SID=sid is not None, BLOCK_D=triton.next_power_of_2(d),
            num_warps=8 if d >= 2048 else 4,
        )
    return xout, y


# --------------------------------------------------------------------------------------------------
# (b) gated residual: res + x * g[sid]
# --------------------------------------------------------------------------------------------------
@triton.jit
def _gated_res_kernel(R, X, G, OUT, SID, D, HAS_SID: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    sid = 0
    if HAS_SID:
        sid = tl.load(SID + row).to(tl.int64)
    r = tl.load(R + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + sid * D + cols, mask=mask, other=0.0)
    tl.store(OUT + row * D + cols, (r + x * g).to(OUT.dtype.element_ty), mask=mask)


def gated_residual(res, x, g, sid=None):
    n, d = res.shape
    out = torch.empty_like(res)
    if n:
        _gated_res_kernel[(n,)](res, x, g, out, sid if sid is not None else g, d,
                                HAS_SID=sid is not None, BLOCK_D=triton.next_power_of_2(d),
                                num_warps=8 if d >= 2048 else 4)
    return out


# --------------------------------------------------------------------------------------------------
# (c) qk RMSNorm (weight) + RoPE (adjacent pairs) + scatter into the packed attention layout
# --------------------------------------------------------------------------------------------------
@triton.jit
def _qk_norm_rope_half(base, OUT, w_e, w_o, c, s, eps, hmask, D: tl.constexpr, HAS_ROPE: tl.constexpr):
    """base: (BLOCK_H, D/2) pointers of the even features of one token's q or k."""
    e = tl.load(base, mask=hmask, other=0.0).to(tl.float32)
    o = tl.load(base + 1, mask=hmask, other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(e * e, axis=1) + tl.sum(o * o, axis=1)) / D + eps)[:, None]
    # the torch path stores the normalised (weighted) head in the stream dtype before RoPE
    e = (e * r * w_e).to(OUT.dtype.element_ty).to(tl.float32)
    o = (o * r * w_o).to(OUT.dtype.element_ty).to(tl.float32)
    if HAS_ROPE:
        e, o = e * c - o * s, o * c + e * s
    return e, o


@triton.jit
def _qkv_pack_kernel(QKV, SRC, DST, WQ, WK, COS, SIN, Q, K, V, H, R2, eps,
                     D: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_SRC: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    src = i
    if HAS_SRC:
        src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    j = tl.arange(0, D // 2)
    hmask = (hs < H)[:, None]
    off = hs[:, None] * D + 2 * j[None, :]  # even features of every head
    row = QKV + src * (3 * H * D)
    c = 1.0
    s = 0.0
    if HAS_ROPE:
        jm = j < R2
        c = tl.load(COS + src * R2 + j, mask=jm, other=1.0)[None, :]
        s = tl.load(SIN + src * R2 + j, mask=jm, other=0.0)[None, :]
    dt = Q.dtype.element_ty
    out = dst * (H * D) + off
    wq_e = tl.load(WQ + 2 * j).to(tl.float32)[None, :]
    wq_o = tl.load(WQ + 2 * j + 1).to(tl.float32)[None, :]
    e, o = _qk_norm_rope_half(row + off, Q, wq_e, wq_o, c, s, eps, hmask, D, HAS_ROPE)
    tl.store(Q + out, e.to(dt), mask=hmask)
    tl.store(Q + out + 1, o.to(dt), mask=hmask)
    wk_e = tl.load(WK + 2 * j).to(tl.float32)[None, :]
    wk_o = tl.load(WK + 2 * j + 1).to(tl.float32)[None, :]
    e, o = _qk_norm_rope_half(row + H * D + off, K, wk_e, wk_o, c, s, eps, hmask, D, HAS_ROPE)
    tl.store(K + out, e.to(dt), mask=hmask)
    tl.store(K + out + 1, o.to(dt), mask=hmask)
    ve = tl.load(row + 2 * H * D + off, mask=hmask, other=0.0)
    vo = tl.load(row + 2 * H * D + off + 1, mask=hmask, other=0.0)
    tl.store(V + out, ve, mask=hmask)
    tl.store(V + out + 1, vo, mask=hmask)


def qkv_norm_rope_pack(qkv, heads, head_dim, wq, wk, eps, cos, sin, dst, q, k, v, src=None):
    """qkv (N, 3*H*D): for each output row i, token src[i] (default i) is written to row dst[i] of
    q/k/v (N_all, H, D): q, k RMS-normalised per head (weight wq/wk) then rotated by cos/sin[src]
    ((N, R/2) fp32, one entry per pair; None: no RoPE); v copied."""
    n = dst.shape[0]
    if n == 0:
        return
    has_rope = cos is not None
    _qkv_pack_kernel[(n,)](
        qkv, src if src is not None else dst, dst, wq, wk,
        cos if has_rope else wq, sin if has_rope else wq, q, k, v,
        heads, cos.shape[1] if has_rope else 0, float(eps),
        D=head_dim, HAS_ROPE=has_rope, HAS_SRC=src is not None,
        BLOCK_H=triton.next_power_of_2(heads), num_warps=4,
    )


@triton.jit
def qkv_pack_kernel_v2(QKV, SRC, DST, WQ, WK, COS, SIN, OUT, N_ALL, H, R2, eps,
                        D: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_SRC: tl.constexpr,
                        BLOCK_H: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (rows, 3): slot 0/1 = q/k (norm + RoPE), slot 2 = v (copy). Contiguous (16-byte) loads and
    stores of whole head rows; the pair partner is re-read through the cache with the index d^1 (the
    flash-attn Triton rotary does the same), so no strided 2-byte global accesses. SPLIT ("v3"): the pairs
    are separated in registers (reshape + split / join) instead of re-read."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    src = i
    if HAS_SRC:
        src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    hmask = (hs < H)[:, None]
    inp = QKV + src * (3 * H * D) + slot * (H * D)
    off = hs[:, None] * D + d[None, :]
    out = OUT + slot.to(tl.int64) * N_ALL * H * D + dst * (H * D) + off
    x = tl.load(inp + off, mask=hmask, other=0.0)
    if slot == 2:
        tl.store(out, x, mask=hmask)
    elif SPLIT:
        xf = x.to(tl.float32)
        if slot == 0:
            w = tl.load(WQ + d).to(tl.float32)
        else:
            w = tl.load(WK + d).to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        y = (xf * r * w[None, :]).to(x.dtype).to(tl.float32)
        if HAS_ROPE:
            e, o = tl.split(tl.reshape(y, (BLOCK_H, D // 2, 2)))
            j = tl.arange(0, D // 2)
            c = tl.load(COS + src * R2 + j, mask=j < R2, other=1.0)[None, :]
            s = tl.load(SIN + src * R2 + j, mask=j < R2, other=0.0)[None, :]
            y = tl.reshape(tl.join(e * c - o * s, o * c + e * s), (BLOCK_H, D))
        tl.store(out, y.to(x.dtype), mask=hmask)
    else:
        dp = d ^ 1  # the other element of each rotated pair
        xp = tl.load(inp + hs[:, None] * D + dp[None, :], mask=hmask, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        if slot == 0:
            w = tl.load(WQ + d).to(tl.float32)
            wp = tl.load(WQ + dp).to(tl.float32)
        else:
            w = tl.load(WK + d).to(tl.float32)
            wp = tl.load(WK + dp).to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        # the torch path stores the normalised (weighted) head in the stream dtype before RoPE
        y = (xf * r * w[None, :]).to(x.dtype).to(tl.float32)
        if HAS_ROPE:
            yp = (xp * r * wp[None, :]).to(x.dtype).to(tl.float32)
            pm = (d // 2) < R2
            c = tl.load(COS + src * R2 + d // 2, mask=pm, other=1.0)
            s = tl.load(SIN + src * R2 + d // 2, mask=pm, other=0.0)
            s = tl.where(d % 2 == 0, -s, s)
            y = y * c[None, :] + yp * s[None, :]
        tl.store(out, y.to(x.dtype), mask=hmask)


def qkv_norm_rope_pack_v2(qkv, heads, head_dim, wq, wk, eps, cos, sin, dst, out, src=None, split=False):
    """As :func:`qkv_norm_rope_pack`, into ``out`` (3, N_all, H, D) (q, k, v = out[0], out[1], out[2])."""
    n = dst.shape[0]
    if n == 0:
        return
    has_rope = cos is not None
    qkv_pack_kernel_v2[(n, 3)](
        qkv, src if src is not None else dst, dst, wq, wk,
        cos if has_rope else wq, sin if has_rope else wq, out, out.shape[1],
        heads, cos.shape[1] if has_rope else 0, float(eps),
        D=head_dim, HAS_ROPE=has_rope, HAS_SRC=src is not None,
        BLOCK_H=triton.next_power_of_2(heads), SPLIT=split, num_warps=4,
    )


# --------------------------------------------------------------------------------------------------
# SwiGLU gate: silu(a) * b
# --------------------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(A, B, OUT, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    # the torch path rounds silu(a) to the stream dtype before the product
    sa = (a / (1.0 + tl.exp(-a))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + offs, (sa * b).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(a, b):
    out = torch.empty_like(a)
    n = a.numel()
    if n:
        block = 4096
        _silu_mul_kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block, num_warps=8)
    return out
