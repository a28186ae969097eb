"""Triton kernels of the INT8 ConvRot linear (``int8.Int8Linear``): the elementwise passes around ``torch._int_mm``.

* ``rotate_quantize(x, h)``: ``quantize_rows(rotate(x, g))`` in one launch. A program owns a block of rows and loops
  twice over the K/g groups: first ``x_g @ H`` (``tl.dot``, fp32 sums rounded to x's dtype as the reference
  matmul's output) for each row's amax, then the same product again, divided by the row scale (rounded to x's dtype,
  the quotient too), rounded half to even and clamped to int8. Reads x twice and writes the codes once instead of
  ~25 bytes per element over the reference's separate passes. The codes equal the reference's except where the
  rotation's fp32 sum, taken in another order, rounds to a neighbouring value of x's dtype (the bound:
  ``tests/test_int8_fused.py``).
* ``rescale(acc, sx, sw, bias, out_dtype)``: ``(acc.float() * (sx * sw)).to(out_dtype) + bias``, one pass over the
  int32 product, bit for bit the reference expression.

Roundings to bf16 are done on the float32 bits (ties to even) because the Triton interpreter truncates a float32
-> bfloat16 cast; fp16 uses the cast, which both the interpreter and the GPU round to nearest even.
"""
from __future__ import annotations

import torch

from . import launch
from .launch import HAS_TRITON, tl, triton

HALF_DTYPES = (torch.bfloat16, torch.float16)
GROUPS = (16, 64, 256)        # ConvRot group sizes the kernel rotates: tl.dot needs 16+, H must fit on chip
EPILOGUE_BLOCK = (32, 128, 4)   # (BLOCK_M, BLOCK_N, num_warps): 16-byte int32 loads, 32 values per thread


if HAS_TRITON:

    @triton.jit
    def round_to_half(v, F16: tl.constexpr):
        """float32 -> the nearest fp16 (F16) or bf16 value, ties to even, returned as float32."""
        if F16:
            out = v.to(tl.float16).to(tl.float32)
        else:
            b = v.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            out = b.to(tl.float32, bitcast=True)
        return out

    @triton.jit
    def rotate_group(xg, h, DOT_F32: tl.constexpr):
        """``xg @ h`` summed in float32; DOT_F32 (the interpreter, whose bf16 dot is wrong): float32 operands,
        IEEE products, which are the same exact products of half-precision values."""
        if DOT_F32:
            r = tl.dot(xg.to(tl.float32), h.to(tl.float32), input_precision="ieee")
        else:
            r = tl.dot(xg, h)
        return r

    @triton.jit
    def rotate_quant_kernel(x_ptr, h_ptr, q_ptr, s_ptr, M, K, stride_xm, tiny,
                            G: tl.constexpr, F16: tl.constexpr, BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = tl.arange(0, G)
        h = tl.load(h_ptr + cols[:, None] * G + cols[None, :])
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :]
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, G):
            xg = tl.load(x_rows + k0, mask=rmask[:, None], other=0.0)
            r = round_to_half(rotate_group(xg, h, DOT_F32), F16)
            amax = tl.maximum(amax, tl.max(tl.abs(r), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-30)
        tl.store(s_ptr + rows, scale, mask=rmask)
        s = round_to_half(scale, F16)
        s = tl.where(s == 0.0, tiny, s)[:, None]
        q_rows = q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        for k0 in range(0, K, G):
            xg = tl.load(x_rows + k0, mask=rmask[:, None], other=0.0)
            r = round_to_half(rotate_group(xg, h, DOT_F32), F16)
            v = round_to_half(tl.math.div_rn(r, s), F16)
            v = tl.minimum(tl.maximum(v, -128.0), 127.0)
            v = (v + 12582912.0) - 12582912.0       # 1.5 * 2^23 in and out: float32 rounds half to even
            tl.store(q_rows + k0, v.to(tl.int8), mask=rmask[:, None])

    @triton.jit
    def rescale_kernel(acc_ptr, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, stride_am,
                       HAS_BIAS: tl.constexpr, F16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        acc = tl.load(acc_ptr + rows[:, None].to(tl.int64) * stride_am + cols[None, :], mask=mask, other=0)
        sx = tl.load(sx_ptr + rows, mask=rmask, other=0.0)
        sw = tl.load(sw_ptr + cols, mask=cmask, other=0.0)
        y = round_to_half(acc.to(tl.float32) * (sx[:, None] * sw[None, :]), F16)
        if HAS_BIAS:
            b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = round_to_half(y + b[None, :], F16)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def fusable(dtype: torch.dtype, group: int | None) -> str:
    """Why the fused kernels cannot take activations of ``dtype`` with ConvRot ``group`` ("" when they can)."""
    if not HAS_TRITON:
        return "Triton is not installed"
    if dtype not in HALF_DTYPES:
        return f"{dtype} activations (the kernels take bf16 / fp16)"
    if group not in GROUPS:
        return f"ConvRot group {group} (the kernels rotate groups of {', '.join(map(str, GROUPS))})"
    return ""


# (max M, BLOCK_M, num_warps, num_stages) of ``rotate_quant_kernel``, the first row whose max M covers M: 16-row
# tiles spread few rows over more programs, 64-row tiles (one Hopper wgmma tile) once there are rows to fill the GPU
ROTATE_QUANT_CONFIGS = ((4096, 16, 4, 2), (1 << 62, 64, 8, 2))


def rotate_quantize(x: torch.Tensor, h: torch.Tensor, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 / fp16), h the [g, g] Hadamard matrix in x's dtype -> (int8 codes [M, K], float32 scales
    [M, 1]): ``int8.quantize_rows(int8.rotate(x, g))`` in one launch (see the module doc for the difference).
    ``config``: a row of ``ROTATE_QUANT_CONFIGS`` to use whatever M (the self-test runs each)."""
    launch.check_triton(x)
    m, k = x.shape
    g = h.shape[0]
    why = fusable(x.dtype, g)
    if why:
        raise ValueError(f"rotate_quantize: {why}")
    if k % g:
        raise ValueError(f"ConvRot group size {g} does not divide the {k} input features")
    if x.stride(1) != 1:
        x = x.contiguous()
    h = h.to(device=x.device, dtype=x.dtype).contiguous()
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    _, block_m, warps, stages = config or next(c for c in ROTATE_QUANT_CONFIGS if m <= c[0])
    grid = (triton.cdiv(m, block_m), 1, 1)
    args = (x, h, q, s, m, k, x.stride(0), float(torch.finfo(x.dtype).tiny))
    consts = dict(G=g, F16=x.dtype == torch.float16, BLOCK_M=block_m, DOT_F32=launch.INTERPRET)
    if launch.INTERPRET:
        rotate_quant_kernel[grid[:1]](*args, **consts, num_warps=warps)
    else:
        launch.launch(rotate_quant_kernel, grid, args, consts, warps, stages)
    return q, s


def rescale(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """int32 acc [M, N] (rows may be strided), float32 row scales sx [M, 1] and column scales sw [N] (or [N, 1], or
    one for all) ->
    ``(acc.float() * (sx * sw)).to(out_dtype) + bias.to(out_dtype)`` bit for bit, in one pass."""
    launch.check_triton(acc)
    if out_dtype not in HALF_DTYPES:
        raise ValueError(f"rescale writes bf16 / fp16, not {out_dtype}")
    m, n = acc.shape
    if acc.stride(1) != 1:
        acc = acc.contiguous()
    sx = sx.to(device=acc.device, dtype=torch.float32).reshape(-1).contiguous()
    sw = sw.to(device=acc.device, dtype=torch.float32).reshape(-1)
    sw = (sw.expand(n) if sw.numel() == 1 else sw).contiguous()
    if sx.numel() != m or sw.numel() != n:
        raise ValueError(f"rescale: {sx.numel()} row and {sw.numel()} column scales for a {m} x {n} product")
    y = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    if m == 0:
        return y
    b = bias.to(device=acc.device, dtype=out_dtype).reshape(-1).contiguous() if bias is not None else sw
    bm, bn, warps = EPILOGUE_BLOCK
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), 1)
    args = (acc, sx, sw, b, y, m, n, acc.stride(0))
    consts = dict(HAS_BIAS=bias is not None, F16=out_dtype == torch.float16, BLOCK_M=bm, BLOCK_N=bn)
    if launch.INTERPRET:
        rescale_kernel[grid[:2]](*args, **consts, num_warps=warps)
    else:
        launch.launch(rescale_kernel, grid, args, consts, warps, 1)
    return y
