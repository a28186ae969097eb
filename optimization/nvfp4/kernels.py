"""Triton kernels for the NVFP4 / FP8 linear paths (optional: ``HAS_TRITON`` says whether they exist).

* ``quantize_act_nvfp4``: activations -> NVFP4 (packed hi_first + E4M3 block scales written directly in the
  swizzled 128x4 layout) in one pass, given a global scale on the device. Bit-exact with
  ``format.quantize_nvfp4(recipe="comfy")``. Used by the sm_100/sm_120 FP4 tensor-core path.
* ``quantize_act_fp8_rowwise``: per-token FP8 E4M3 quantization (amax, scale, cast) in one kernel.
  Bit-exact with ``format.quantize_act_fp8_rowwise_reference``. Used by the sm_89/sm_90 speed path.
* ``dequantize_nvfp4_triton``: NVFP4 -> bf16/fp16/fp32 weight, bit-exact with ``format.dequantize_nvfp4``.
* ``w4a16_linear``: fused NVFP4-weight x bf16-activation GEMM (weights decoded in registers; fp32
  accumulation; global scale and bias in the epilogue). Used by the fidelity path for small M.

All divisions use ``div_rn`` (IEEE round-to-nearest) so results match the CPU reference bit for bit.
None of these kernels uses FP4 instructions, so they run (and are tested) on any GPU Triton supports.
"""
from __future__ import annotations

import torch

from .format import F8_E4M3_MAX, roundup

try:  # pragma: no cover - exercised on GPU machines
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # noqa: BLE001
    triton = None
    tl = None
    HAS_TRITON = False

MAX_ELEMENTS_PER_CALL = 2 ** 31 - 2 ** 20   # stay clear of 32-bit index overflow inside one launch


import os

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # lets the CPU run the kernels (tests only)


def triton_usable(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or _INTERPRET)


if HAS_TRITON:

    @triton.jit
    def _e2m1_code(d):
        """float32 (already scaled, any range) -> 4-bit code, RNE, saturating; sign from the IEEE sign bit."""
        a = tl.abs(d)
        c = (a > 0.25).to(tl.int32)
        c += (a >= 0.75).to(tl.int32)
        c += (a > 1.25).to(tl.int32)
        c += (a >= 1.75).to(tl.int32)
        c += (a > 2.5).to(tl.int32)
        c += (a >= 3.5).to(tl.int32)
        c += (a > 5.0).to(tl.int32)
        neg = (d.to(tl.int32, bitcast=True) >> 31) & 1
        return c | (neg << 3)

    @triton.jit
    def _e2m1_value(code):
        """4-bit code (int32) -> float32 value."""
        mag = code & 7
        e = mag >> 1
        m = mag & 1
        normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
        val = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
        return tl.where((code & 8) != 0, -val, val)

    @triton.jit
    def _e2m1_pair_f32(p, lut_ptr):
        """packed byte (int32) -> (value of the high nibble, value of the low nibble) as float32, via the
        256-entry table of bf16 bit pairs (a bf16 shifted left 16 bits is the same float32 value)."""
        v = tl.load(lut_ptr + p)
        hi = (v << 16).to(tl.float32, bitcast=True)
        lo = ((v >> 16) << 16).to(tl.float32, bitcast=True)
        return hi, lo

    @triton.jit
    def _swz_offset(row, col, NCB4):
        return ((row // 128) * NCB4 + col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4

    @triton.jit
    def _act_nvfp4_kernel(x_ptr, q_ptr, s_ptr, g_ptr, M, K, stride_xm, row0, NCB4,
                          BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_b = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_b * BLOCK_B * 16 + tl.arange(0, BLOCK_B * 16)
        rmask = rows < M
        cmask = cols < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr)
        xb = tl.reshape(x, (BLOCK_M, BLOCK_B, 16))
        amax = tl.max(tl.abs(xb), axis=2)
        s = tl.math.div_rn(tl.math.div_rn(amax, 6.0), g)
        s = tl.minimum(s, 448.0)
        s8 = s.to(tl.float8e4nv)
        total = g * s8.to(tl.float32)
        zero = total == 0.0
        safe = tl.where(zero, 1.0, total)
        d = tl.math.div_rn(xb, safe[:, :, None])
        d = tl.where(zero[:, :, None], 0.0, d)
        d = tl.minimum(tl.maximum(d, -6.0), 6.0)
        codes = _e2m1_code(d)
        codes = tl.reshape(codes, (BLOCK_M, BLOCK_B * 8, 2))
        even, odd = tl.split(codes)
        byte = ((even << 4) | odd).to(tl.uint8)
        pcols = pid_b * BLOCK_B * 8 + tl.arange(0, BLOCK_B * 8)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], byte,
                 mask=rmask[:, None] & (pcols[None, :] < K // 2))
        bcols = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        grow = rows + row0
        off = _swz_offset(grow[:, None].to(tl.int64), bcols[None, :], NCB4)
        tl.store(s_ptr + off, s8, mask=rmask[:, None] & (bcols[None, :] < K // 16))

    @triton.jit
    def _act_fp8_row_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        inv = tl.math.div_rn(1.0, scale)
        q = x * inv
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.autotune(configs=[triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                              for r, c, w in ((32, 64, 4), (16, 256, 4), (32, 256, 8), (8, 512, 4), (64, 128, 8),
                                              (16, 512, 8), (4, 1024, 4))],
                     key=["R", "HALF"])
    @triton.jit
    def _dequant_kernel(p_ptr, s_ptr, lut_ptr, g_ptr, o_ptr, R, HALF, N_OUT, K_OUT, NCB4,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        pcols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (pcols[None, :] < HALF)
        p = tl.load(p_ptr + rows[:, None].to(tl.int64) * HALF + pcols[None, :], mask=mask, other=0).to(tl.int32)
        g = tl.load(g_ptr)
        blk = (pcols * 2) // 16
        soff = _swz_offset(rows[:, None].to(tl.int64), blk[None, :], NCB4)
        s = tl.load(s_ptr + soff, mask=mask, other=0.0).to(tl.float32)
        total = g * s
        hv, lv = _e2m1_pair_f32(p, lut_ptr)
        hi = hv * total
        lo = lv * total
        vals = tl.reshape(tl.join(hi, lo), (BLOCK_R, BLOCK_C * 2))
        ocols = pid_c * BLOCK_C * 2 + tl.arange(0, BLOCK_C * 2)
        omask = (rows[:, None] < N_OUT) & (ocols[None, :] < K_OUT)
        tl.store(o_ptr + rows[:, None].to(tl.int64) * K_OUT + ocols[None, :], vals.to(o_ptr.dtype.element_ty),
                 mask=omask)

    def _w4a16_configs():
        out = []
        for bm, bn, bk, sk, w, st in ((16, 64, 128, 1, 4, 4), (16, 64, 128, 4, 4, 4), (16, 128, 128, 2, 4, 4),
                                      (32, 64, 128, 2, 4, 4), (32, 128, 128, 4, 4, 4), (64, 64, 128, 2, 4, 3),
                                      (64, 128, 64, 1, 4, 3), (64, 128, 128, 4, 8, 3), (64, 128, 128, 1, 8, 3),
                                      (128, 128, 64, 1, 8, 3), (128, 128, 64, 2, 8, 3), (128, 64, 128, 4, 4, 3),
                                      (256, 64, 64, 2, 8, 3), (256, 128, 64, 1, 8, 3)):
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk},
                                     num_warps=w, num_stages=st))
        return out

    @triton.jit
    def _w4a16_kernel_raw(x_ptr, p_ptr, s_ptr, lut_ptr, g_ptr, ws_ptr, M, N, K, M_BUCKET, stride_xm, NCB4,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr):
        """ws[M, N] (+)= x @ dequant(W)^T * g in fp32. Each packed byte is decoded by one lookup in a
        256-entry table holding both of its values (exact); q * s_block is exact in bf16 (<= 6 significant
        bits); the global scale is applied to the fp32 accumulator. Split-K programs add atomically."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rkp = tl.arange(0, BLOCK_K // 2)
        HALF = K // 2
        k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        mmask = rm[:, None] < M
        nmask = rn[:, None] < N
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=mmask & (kk[None, :] < K), other=0.0)
            pk = k0 // 2 + rkp
            pm = nmask & (pk[None, :] < HALF)
            p = tl.load(p_ptr + rn[:, None].to(tl.int64) * HALF + pk[None, :], mask=pm, other=0).to(tl.int32)
            kb = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            s = tl.load(s_ptr + _swz_offset(rn[:, None].to(tl.int64), kb[None, :], NCB4),
                        mask=nmask & (kb[None, :] < K // 16), other=0.0).to(tl.float32)
            hv, lv = _e2m1_pair_f32(p, lut_ptr)
            w = tl.reshape(tl.join(hv, lv), (BLOCK_N, BLOCK_K // 16, 16))
            w = tl.reshape(w * s[:, :, None], (BLOCK_N, BLOCK_K)).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc)
        g = tl.load(g_ptr)
        acc = acc * g
        optr = ws_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
        omask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(optr, acc, mask=omask)
        else:
            tl.atomic_add(optr, acc, mask=omask, sem="relaxed")

    _w4a16_kernel = triton.autotune(configs=_w4a16_configs(), key=["M_BUCKET", "N", "K"],
                                    reset_to_zero=["ws_ptr"])(_w4a16_kernel_raw)


_LUT_DEV: dict = {}


def byte_lut(device) -> torch.Tensor:
    """int32[256]: bf16 bits of the byte's high-nibble value in bits 0-15, low-nibble value in bits 16-31."""
    key = str(device)
    t = _LUT_DEV.get(key)
    if t is None:
        from .format import E2M1_VALUES
        vals = torch.tensor(E2M1_VALUES, dtype=torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        b = torch.arange(256)
        t = (vals[b >> 4] | (vals[b & 15] << 16)).to(torch.int32).to(device)
        _LUT_DEV[key] = t
    return t


def _check_triton(t: torch.Tensor):
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    if not (t.is_cuda or _INTERPRET):
        raise RuntimeError("Triton kernels need a CUDA tensor")


def quantize_act_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, chunk_rows: int | None = None):
    """x [M, K] (K % 16 == 0) -> (packed uint8 [M, K/2] hi_first, swizzled e4m3 scales
    [roundup(M,128), roundup(K/16,4)]). Large inputs are processed in row chunks (multiples of 128) so no
    launch indexes more than ``MAX_ELEMENTS_PER_CALL`` elements; the global scale is the whole tensor's."""
    _check_triton(x)
    M, K = x.shape
    if K % 16:
        raise ValueError(f"K={K} is not a multiple of 16")
    if x.stride(1) != 1:
        x = x.contiguous()
    nb = K // 16
    sr, sc = roundup(M, 128), roundup(nb, 4)
    q = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    pad = (sr != M) or (sc != nb)
    s = (torch.zeros if pad else torch.empty)((sr, sc), dtype=torch.float8_e4m3fn, device=x.device)
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    if chunk_rows is None:
        chunk_rows = max(128, (MAX_ELEMENTS_PER_CALL // max(K, 1)) // 128 * 128)
    BLOCK_M, BLOCK_B = 32, 8
    for r0 in range(0, M, chunk_rows):
        mc = min(chunk_rows, M - r0)
        grid = (triton.cdiv(mc, BLOCK_M), triton.cdiv(nb, BLOCK_B))
        _act_nvfp4_kernel[grid](x[r0:r0 + mc], q[r0:r0 + mc], s, g, mc, K, x.stride(0), r0, sc // 4,
                                BLOCK_M=BLOCK_M, BLOCK_B=BLOCK_B, num_warps=4)
    return q, s


def quantize_act_fp8_rowwise(x: torch.Tensor):
    """x [M, K] -> (fp8 e4m3 [M, K], scale fp32 [M]) with scale = amax_row / 448."""
    _check_triton(x)
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    BLOCK_K = triton.next_power_of_2(K)
    warps = max(4, min(16, BLOCK_K // 512))
    _act_fp8_row_kernel[(M,)](x, q, s, K, x.stride(0), BLOCK_K=BLOCK_K, num_warps=warps)
    return q, s


def dequantize_nvfp4_triton(packed, block_scale, global_scale, shape, dtype=torch.bfloat16, out=None):
    """NVFP4 (internal convention) -> ``dtype`` [shape], bit-exact with ``format.dequantize_nvfp4``."""
    _check_triton(packed)
    R, HALF = packed.shape
    n, k = shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=packed.device)
    sc = block_scale.shape[1]
    g = global_scale.to(device=packed.device, dtype=torch.float32).reshape(1)
    kh = min(HALF, (k + 1) // 2)
    if _INTERPRET:
        _dequant_kernel.fn[(triton.cdiv(n, 32), triton.cdiv(kh, 64))](packed, block_scale, byte_lut(packed.device),
                                                                       g, out, R, HALF, n, k, sc // 4,
                                                                       BLOCK_R=32, BLOCK_C=64)
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_R"]), triton.cdiv(kh, meta["BLOCK_C"]))  # noqa: E731
        _dequant_kernel[grid](packed, block_scale, byte_lut(packed.device), g, out, R, HALF, n, k, sc // 4)
    return out


def _m_bucket(m: int) -> int:
    for b in (16, 32, 64, 128, 256, 512, 1024):
        if m <= b:
            return b
    return 2048


def w4a16_linear(x: torch.Tensor, packed, block_scale, global_scale, n: int, bias=None):
    """y[M, n] = x[M, Kp] @ dequant(W)^T (+ bias), fp32 accumulation, output in x's dtype.
    x must already be padded to the weight's padded K. Split-K over the grid keeps the GPU busy at small M."""
    _check_triton(x)
    M, K = x.shape
    if packed.shape[1] * 2 != K:
        raise ValueError(f"activation K={K} does not match the packed weight's K={packed.shape[1] * 2}")
    if x.stride(1) != 1:
        x = x.contiguous()
    ws = torch.zeros((M, n), dtype=torch.float32, device=x.device)
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    sc = block_scale.shape[1]
    args = (x, packed, block_scale, byte_lut(x.device), g, ws, M, n, K, _m_bucket(M), x.stride(0), sc // 4)
    if _INTERPRET:
        grid = (triton.cdiv(n, 32), triton.cdiv(M, 16), 1)
        _w4a16_kernel_raw[grid](*args, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1)
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"]), meta["SPLIT_K"])  # noqa: E731
        _w4a16_kernel[grid](*args)
    if bias is not None:
        ws += bias.float()
    return ws.to(x.dtype)
