"""Triton kernels of the NVFP4 / FP8 linears, as free functions (``HAS_TRITON`` says whether they exist).

* ``quantize_act_nvfp4``: activations -> NVFP4 (packed hi_first + E4M3 block scales written directly in the
  swizzled 128x4 layout) in one pass, given a global scale on the device. Bit-exact with
  ``format.quantize_nvfp4(recipe="comfy")``. Used by the sm_100/sm_120 FP4 tensor-core path.
* ``quantize_act_fp8_rowwise``: per-token FP8 E4M3 quantization (amax, scale, cast) in one kernel.
  Bit-exact with ``format.quantize_act_fp8_rowwise_reference``. Used by the sm_89/sm_90 speed path.
* ``dequantize_nvfp4_triton``: NVFP4 -> bf16/fp16/fp32 weight, bit-exact with ``format.dequantize_nvfp4``.
* ``w4a16_linear``: fused NVFP4-weight x bf16-activation GEMM, "swap AB" (the decoded weight tile is the wide
  MMA operand, so BLOCK_M can be 16), tiles from ``W4A16_CONFIGS`` by M, split-K into fp32 partials + one
  reduce kernel (no atomics, no zero fill); global scale and bias in the epilogue. Fidelity path, small M.
* ``transpose_2d``: 1-byte tensors transposed near copy bandwidth (FP8 training).

Launching (the cached relaunch, the seams, split-K) is ``launch.py``'s; the per-shape launch plans are
``plans.py``'s. All divisions use ``div_rn`` (IEEE round-to-nearest) so results match the CPU reference bit for
bit. None of these kernels uses FP4 instructions, so they run (and are tested) on any GPU Triton supports.
"""


import torch

from ..runtime import device_cache, knobs
from . import launch
from .format import E2M1_VALUES, fp8_row_exponent, quantize_act_fp8_rowwise_reference, roundup
from .launch import HAS_TRITON, tl, triton, triton_usable  # noqa: F401 - triton_usable: asked here by callers

MAX_ELEMENTS_PER_CALL = 2 ** 31 - 2 ** 20   # stay clear of 32-bit index overflow inside one launch


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

    # Byte tables for ``e2m1_pairs_scaled``: the bf16 / fp16 bit pattern of each E2M1 magnitude 0..7
    # (0, .5, 1, 1.5, 2, 3, 4, 6), split into a high-byte and a low-byte table of 8 bytes each (two 32-bit
    # registers, the operand pair of one PRMT). fp16's low bytes are all zero.
    _E2M1_BF16_HI = (0x3F3F3F00, 0x40404040)
    _E2M1_BF16_LO = (0xC0800000, 0xC0804000)
    _E2M1_F16_HI = (0x3E3C3800, 0x46444240)
    _E2M1_F16_LO = (0x00000000, 0x00000000)

    def _e2m1_asm(hi_tab, lo_tab, f16: bool) -> str:
        """PTX for 4 packed bytes ($4, hi_first nibbles) and their 4 block scales ($5 = [s0, s1], $6 = [s2, s3],
        16-bit floats) -> $0 = [hi0, hi1], $1 = [hi2, hi3], $2 = [lo0, lo1], $3 = [lo2, lo3]: each nibble's
        E2M1 value times its byte's scale, exact (<= 5 significant bits, in range for every E4M3 scale).
        Magnitudes come from two byte-table PRMTs (index = the 3 magnitude bits of a nibble), a third PRMT
        pairs low and high bytes into 16-bit values, a sign-replicating PRMT + LOP3 sets the sign bit; ~3
        instructions per value instead of ~20 for the arithmetic decode."""
        fma = "fma.rn.f16x2" if f16 else "fma.rn.bf16x2"
        return f"""{{
        .reg .b32 sa, sb, ha, la, hb, lb, w4, t, th0, th1, tl0, tl1, z, nz;
        mov.b32 th0, {hi_tab[0]:#010x}; mov.b32 th1, {hi_tab[1]:#010x};
        mov.b32 tl0, {lo_tab[0]:#010x}; mov.b32 tl1, {lo_tab[1]:#010x};
        mov.b32 z, 0; mov.b32 nz, 0x80008000;
        and.b32 sa, $4, 0x7777;
        shr.u32 sb, $4, 16;
        and.b32 sb, sb, 0x7777;
        prmt.b32 ha, th0, th1, sa;
        prmt.b32 la, tl0, tl1, sa;
        prmt.b32 hb, th0, th1, sb;
        prmt.b32 lb, tl0, tl1, sb;
        shl.b32 w4, $4, 4;
        prmt.b32 $0, la, ha, 0x7351;
        prmt.b32 t, $4, z, 0x9484;
        lop3.b32 $0, $0, t, nz, 0xF8;
        prmt.b32 $1, lb, hb, 0x7351;
        prmt.b32 t, $4, z, 0xB4A4;
        lop3.b32 $1, $1, t, nz, 0xF8;
        prmt.b32 $2, la, ha, 0x6240;
        prmt.b32 t, w4, z, 0x9484;
        lop3.b32 $2, $2, t, nz, 0xF8;
        prmt.b32 $3, lb, hb, 0x6240;
        prmt.b32 t, w4, z, 0xB4A4;
        lop3.b32 $3, $3, t, nz, 0xF8;
        {fma} $0, $0, $5, nz;
        {fma} $1, $1, $6, nz;
        {fma} $2, $2, $5, nz;
        {fma} $3, $3, $6, nz;
        }}"""

    _E2M1_ASM_BF16 = tl.constexpr(_e2m1_asm(_E2M1_BF16_HI, _E2M1_BF16_LO, False))
    _E2M1_ASM_F16 = tl.constexpr(_e2m1_asm(_E2M1_F16_HI, _E2M1_F16_LO, True))

    @triton.jit
    def e2m1_pairs_scaled(p, s, F16: tl.constexpr):
        """packed bytes p (uint8) and per-byte scales s (bf16 or fp16, p's shape) -> (value of the high nibble,
        value of the low nibble) * s in s's dtype, exact. CUDA only (inline PTX; sm_80+)."""
        if F16:
            hv, lv = tl.inline_asm_elementwise(_E2M1_ASM_F16, "=r,=r,=r,=r,r,r,r", [p, s],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            hv, lv = tl.inline_asm_elementwise(_E2M1_ASM_BF16, "=r,=r,=r,=r,r,r,r", [p, s],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return hv, lv

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
    def _transpose_kernel(x_ptr, y_ptr, R, C, BLOCK: tl.constexpr):
        """y[C, R] = x[R, C].T, one BLOCK x BLOCK tile per program (both sides coalesced)."""
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tile = tl.load(x_ptr + r[:, None].to(tl.int64) * C + c[None, :], mask=(r[:, None] < R) & (c[None, :] < C))
        tl.store(y_ptr + c[:, None].to(tl.int64) * R + r[None, :], tl.trans(tile),
                 mask=(c[:, None] < C) & (r[None, :] < R))

    @triton.jit
    def act_fp8_row_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
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

    # H100 (device probe dequant_probe.py, commit 062f86d): (16,128,4), (8,256,4), (16,256,8) won on the six
    # SeedVR2 shapes, 2.5-3.0 TB/s (bytes read + written; a bf16 copy moves 2.7-2.9 TB/s in the same run)
    @triton.autotune(configs=[triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                              for r, c, w in ((16, 128, 4), (8, 256, 4), (16, 256, 8), (4, 512, 4), (32, 64, 4),
                                              (32, 128, 8))],
                     key=["R", "HALF", "HALF_C", "ASM_DECODE", "L2_KEEP"], **launch.AUTOTUNE_DISK_CACHE)
    @triton.jit
    def dequant_kernel(p_ptr, s_ptr, lut_ptr, g_ptr, o_ptr, R, HALF, N_OUT, K_OUT, NCB4, C0, HALF_C,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ASM_DECODE: tl.constexpr,
                        L2_KEEP: tl.constexpr):
        """Packed columns [C0, C0 + HALF_C) of every row (C0 a multiple of 8: whole 16-blocks) ->
        o[N_OUT, K_OUT] (K_OUT <= 2 * HALF_C), ``code_value * (g * block_scale)`` in fp32 then one cast (as
        ``format.dequantize_nvfp4``). The tile is [rows, 16-blocks, 8 bytes]: one scale load per block. Codes
        decode by the PRMT byte tables (ASM_DECODE; exact, the value times 1.0) or by the 256-entry table
        gather (the Triton interpreter). The PTX decode and the per-block scales: 1.05-1.5x the per-byte
        version, at the HBM copy rate (H100, commit 062f86d). L2_KEEP: the stores carry the L2 evict_last hint,
        for a weight the next kernel (the fidelity GEMM) reads straight back (see ``dequantize_nvfp4_triton``)."""
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        NB: tl.constexpr = BLOCK_C // 8
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        blk = pid_c * NB + tl.arange(0, NB)
        pcol = blk[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        rmask = rows < R
        mask = rmask[:, None, None] & (pcol < HALF_C)
        p = tl.load(p_ptr + rows[:, None, None].to(tl.int64) * HALF + C0 + pcol, mask=mask, other=0)
        g = tl.load(g_ptr)
        soff = _swz_offset(rows[:, None].to(tl.int64), (C0 // 8 + blk)[None, :], NCB4)
        s = tl.load(s_ptr + soff, mask=rmask[:, None] & (blk[None, :] * 8 < HALF_C), other=0.0).to(tl.float32)
        total = (g * s)[:, :, None]
        if ASM_DECODE:
            hb, lb = e2m1_pairs_scaled(p, tl.full(p.shape, 1.0, tl.bfloat16), False)
            hv = hb.to(tl.float32)
            lv = lb.to(tl.float32)
        else:
            hv, lv = _e2m1_pair_f32(p.to(tl.int32), lut_ptr)
        vals = tl.reshape(tl.join(hv * total, lv * total), (BLOCK_R, BLOCK_C * 2))
        ocols = pid_c * BLOCK_C * 2 + tl.arange(0, BLOCK_C * 2)
        omask = (rows[:, None] < N_OUT) & (ocols[None, :] < K_OUT)
        o_ptrs = o_ptr + rows[:, None].to(tl.int64) * K_OUT + ocols[None, :]
        if L2_KEEP:
            tl.store(o_ptrs, vals.to(o_ptr.dtype.element_ty), mask=omask, eviction_policy="evict_last")
        else:
            tl.store(o_ptrs, vals.to(o_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def w4a16_swab_kernel(x_ptr, p_ptr, s_ptr, g_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, NCB4, TILES_PER,
                           HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                           ASM_DECODE: tl.constexpr, TRANS_STORE: tl.constexpr):
        """y^T[N, M] = dequant(W)[N, K] @ x^T[K, M] ("swap AB": the weight tile, decoded in registers, is the
        MMA's wide operand; the few activation rows are the narrow one, so BLOCK_M can be 16).
        The packed weight is read once per M tile (0.5 B/weight + scales). fp32 accumulation; the global
        scale (and bias, cast) in the epilogue when SPLIT_K == 1, else fp32 partials ws[SPLIT_K, M, N] for
        ``_splitk_reduce_kernel`` (no atomics, no zero-fill)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn_l = rn % N                                   # rows past N re-read valid rows; masked at the store
        rm_l = rm % M
        rkp = tl.arange(0, BLOCK_K // 2)
        rk = tl.arange(0, BLOCK_K)
        rb = tl.arange(0, BLOCK_K // 16)
        HALF = K // 2
        p_base = p_ptr + rn_l[:, None].to(tl.int64) * HALF
        x_base = x_ptr + rm_l[None, :].to(tl.int64) * stride_xm
        # swizzled 128x4 scale layout (``_swz_offset``) split into a row part and a column part: a K tile's scales
        # are then runs of 4 contiguous bytes per row, which Triton's pipeliner copies ahead asynchronously
        # (the per-element offset it could not analyse cost a synchronous load + a layout shuffle per K tile)
        s_row = ((rn_l // 128).to(tl.int64) * NCB4 * 512 + (rn_l % 32) * 16 + ((rn_l % 128) // 32) * 4)[:, None]
        s_col = ((rb // 4) * 512 + rb % 4)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for t in range(0, TILES_PER):
            k0 = (pid_k * TILES_PER + t) * BLOCK_K      # a multiple of 64 (BLOCK_K is)
            kb = k0 // 16 + rb
            soff = s_row + (k0 // 64) * 512 + s_col
            if EVEN_K:
                p = tl.load(p_base + (k0 // 2 + rkp)[None, :])
                xt = tl.load(x_base + (k0 + rk)[:, None])
                sv = tl.load(s_ptr + soff)
            else:
                pk = k0 // 2 + rkp
                p = tl.load(p_base + pk[None, :], mask=pk[None, :] < HALF, other=0)
                kk = k0 + rk
                xt = tl.load(x_base + kk[:, None], mask=kk[:, None] < K, other=0.0)
                sv = tl.load(s_ptr + soff, mask=kb[None, :] < K // 16, other=0.0)
            if ASM_DECODE:
                sb = tl.broadcast_to(sv.to(x_ptr.dtype.element_ty)[:, :, None], (BLOCK_N, BLOCK_K // 16, 8))
                hv, lv = e2m1_pairs_scaled(p, tl.reshape(sb, (BLOCK_N, BLOCK_K // 2)),
                                            x_ptr.dtype.element_ty == tl.float16)
                w = tl.reshape(tl.join(hv, lv), (BLOCK_N, BLOCK_K))
            else:
                p = p.to(tl.int32)
                hv = _e2m1_value((p >> 4) & 15)
                lv = _e2m1_value(p & 15)
                w = tl.reshape(tl.join(hv, lv), (BLOCK_N, BLOCK_K // 16, 16))
                sf = sv.to(tl.float32)
                w = tl.reshape(w * sf[:, :, None], (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
            acc = tl.dot(w, xt, acc)
        omask = (rn[:, None] < N) & (rm[None, :] < M)
        if SPLIT_K == 1:
            acc = acc * tl.load(g_ptr)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn_l).to(tl.float32)[:, None]
            if TRANS_STORE:    # transpose in the kernel (through shared memory): rows of y stored contiguously
                tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :],
                         tl.trans(acc.to(y_ptr.dtype.element_ty)), mask=tl.trans(omask))
            else:
                tl.store(y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], acc.to(y_ptr.dtype.element_ty),
                         mask=omask)
        else:
            tl.store(ws_ptr + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc, mask=omask)


_LUT_DEV: dict = device_cache.cache()


def byte_lut(device) -> torch.Tensor:
    """int32[256]: bf16 bits of the byte's high-nibble value in bits 0-15, low-nibble value in bits 16-31."""
    key = str(device)
    t = _LUT_DEV.get(key)
    if t is None:
        vals = torch.tensor(E2M1_VALUES, dtype=torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        b = torch.arange(256)
        t = (vals[b >> 4] | (vals[b & 15] << 16)).to(torch.int32).to(device)
        _LUT_DEV[key] = t
    return t


def quantize_act_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, chunk_rows: int | None = None):
    """x [M, K] (K % 16 == 0) -> (packed uint8 [M, K/2] hi_first, swizzled e4m3 scales
    [roundup(M,128), roundup(K/16,4)]). Large inputs are processed in row chunks (multiples of 128) so no
    launch indexes more than ``MAX_ELEMENTS_PER_CALL`` elements; the global scale is the whole tensor's."""
    launch.check_triton(x)
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


def quantize_rows_fp8(x: torch.Tensor):
    """The pack's one per-token FP8 quantization (inference and training): the Triton kernel where Triton runs,
    else ``format.quantize_act_fp8_rowwise_reference``, which the kernel reproduces bit for bit."""
    if launch.triton_usable(x):
        return quantize_act_fp8_rowwise(x)
    return quantize_act_fp8_rowwise_reference(x)


def quantize_act_fp8_rowwise(x: torch.Tensor):
    """x [M, K] -> (fp8 e4m3 [M, K], scale fp32 [M]) with scale = amax_row / 448."""
    launch.check_triton(x)
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    BLOCK_K, warps = act_fp8_config(K)
    if launch.INTERPRET:
        act_fp8_row_kernel[(M,)](x, q, s, K, x.stride(0), BLOCK_K=BLOCK_K, num_warps=warps)
    else:
        launch.launch(act_fp8_row_kernel, (M, 1, 1), (x, q, s, K, x.stride(0)), dict(BLOCK_K=BLOCK_K), warps,
                ACT_FP8_STAGES)
    return q, s


TRANSPOSE_BLOCK = 64


def transpose_2d(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a contiguous 2-D tensor of 1-byte elements (fp8 weights): the FP8 input
    gradient ``g @ W`` needs W with N contiguous (cuBLAS FP8 takes K-major operands only). torch's generic strided
    copy moves such a weight at ~0.3 TB/s on an H100 (58 ms of a FLUX.1 1024² training step); this tile kernel
    runs near copy bandwidth."""
    launch.check_triton(x)
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose_2d takes a contiguous 2-D tensor of 1-byte elements, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    R, C = x.shape
    y = torch.empty((C, R), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    xv, yv = x.view(torch.uint8), y.view(torch.uint8)
    grid = (triton.cdiv(R, TRANSPOSE_BLOCK), triton.cdiv(C, TRANSPOSE_BLOCK))
    if launch.INTERPRET:
        _transpose_kernel[grid](xv, yv, R, C, BLOCK=TRANSPOSE_BLOCK, num_warps=4)
    else:
        launch.launch(_transpose_kernel, grid + (1,), (xv, yv, R, C), dict(BLOCK=TRANSPOSE_BLOCK), 4, 3)
    return y


ACT_FP8_STAGES = 3   # Triton's default num_stages on NVIDIA (the kernel has no loop: no effect on the code)


def act_fp8_config(K: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of the per-token FP8 kernel for rows of K elements."""
    block_k = 1 << max(0, (K - 1).bit_length())     # triton.next_power_of_2
    return block_k, max(4, min(16, block_k // 512))


def dequant_args(packed, block_scale, g, out, n: int, k: int, col0: int, l2_keep: bool = False):
    """(arguments of ``dequant_kernel``, its cached-relaunch key, half_c) for one dequantize call; shared by
    ``dequantize_nvfp4_triton`` and ``plans.dequant_plan`` so the plan finds what the full call cached."""
    R, HALF = packed.shape
    c0 = col0 // 2
    half_c = min(HALF - c0, (k + 1) // 2)
    args = (packed, block_scale, byte_lut(packed.device), g, out, R, HALF, n, k, block_scale.shape[1] // 4, c0,
            half_c)
    key = ("dq", packed.device.index, R, HALF, half_c, out.dtype, W4A16_ASM_DECODE, bool(l2_keep),
           launch.spec_key(args))
    return args, key, half_c


def dequantize_nvfp4_triton(packed, block_scale, global_scale, shape, dtype=torch.bfloat16, out=None,
                            col0: int = 0, l2_keep: bool = False):
    """NVFP4 (internal convention) -> ``dtype`` [shape], bit-exact with ``format.dequantize_nvfp4``.
    ``col0`` (a multiple of 16): dequantize columns [col0, col0 + shape[1]) of the weight only.

    ``l2_keep``: store with the L2 evict_last hint, for an ``out`` that the next kernel reads straight back
    and that is reused call after call (the fidelity path's shared scratch weight). H100, M = 4096
    (device probe l2_persist_probe.py, docs/PERFORMANCE.md §8): without the hint, dequantize + cuBLAS ran at 0.79-0.82x
    bf16 whenever other work had gone through the L2 since the last call (the dequantize alone ~50 us for a
    34 MiB weight instead of ~20); with it, 0.87-1.02x in every order (the most for weights that fit in L2)."""
    launch.check_triton(packed)
    n, k = shape
    if col0 % 16:
        raise ValueError(f"col0={col0} is not a multiple of 16")
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=packed.device)
    g = global_scale.to(device=packed.device, dtype=torch.float32).reshape(1)
    l2_keep = bool(l2_keep)
    args, key, kh = dequant_args(packed, block_scale, g, out, n, k, col0, l2_keep)
    if launch.INTERPRET:
        dequant_kernel.fn[(triton.cdiv(n, 32), triton.cdiv(kh, 64))](*args, BLOCK_R=32, BLOCK_C=64,
                                                                        ASM_DECODE=False, L2_KEEP=False)
    else:
        if not launch.FAST_LAUNCH[0]:
            key = None
        else:
            ent = launch.FAST_CACHE.get(key)
            if ent is not None:
                kern, br, bc = ent
                if launch.relaunch(kern, (-(-n // br), -(-kh // bc), 1), args, (br, bc, W4A16_ASM_DECODE, l2_keep),
                                   packed.device):
                    return out
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_R"]), triton.cdiv(kh, meta["BLOCK_C"]))  # noqa: E731
        kern = dequant_kernel[grid](*args, ASM_DECODE=W4A16_ASM_DECODE, L2_KEEP=l2_keep)
        if hasattr(kern, "result"):
            kern = kern.result()
        cfg = getattr(dequant_kernel, "best_config", None)
        if (key is not None and launch.FAST_LAUNCH[0] and cfg is not None and hasattr(kern, "packed_metadata")
                and not launch.hooks_set() and set(cfg.kwargs) == {"BLOCK_R", "BLOCK_C"}):
            launch.FAST_CACHE[key] = (kern, cfg.kwargs["BLOCK_R"], cfg.kwargs["BLOCK_C"])
    return out



def nvfp4_to_fp8_rowwise_triton(packed, block_scale, global_scale, shape):
    """``format.nvfp4_to_fp8_rowwise`` bit for bit, in a few bf16 passes instead of a dozen fp32 ones: BlockSwap
    and the memory plan's staging derive a block's FP8 copy each time its weights reach the GPU (7B: 36 blocks a
    run). ``code * block_scale`` is exact in bf16 (a 2-bit times a 4-bit significand, within its exponent range),
    so it is dequantized with a global scale of 1 by the Triton kernel; the row scale is a power of two times the
    global scale, so scaling by it is exact in bf16 too and the one rounding is the cast to E4M3, as in the
    reference."""
    one = torch.ones((), dtype=torch.float32, device=packed.device)
    qs = dequantize_nvfp4_triton(packed, block_scale, one, shape, dtype=torch.bfloat16)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    k = fp8_row_exponent(qs.abs().amax(dim=1), fmax)
    qs.mul_(torch.exp2(-k).to(torch.bfloat16).unsqueeze(1)).clamp_(-fmax, fmax)
    return qs.to(torch.float8_e4m3fn), global_scale.float().to(qs.device) * torch.exp2(k)

# (max M, BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages) for the swap-AB W4A16 kernel; first row whose max M
# covers M is used. SPLIT_K then comes from ``launch.splitk_for`` (a wave / partial-sum cost model).
W4A16_CONFIGS = [
    # H100, bench_nvfp4 --sweep (do_bench median, one launch per sample), K=3072:
    #   M=16:  (64,16,256)  0.023 ms N=3072 / 0.040 ms N=12288 (0.75x / 0.99x bf16) vs (128,16,128) 0.153 / 0.048
    #   M=64:  (128,64,64)  0.024 / 0.052 ms (0.65x / 0.78x bf16)                  vs (128,64,128)  0.032 / 0.082
    (16, 64, 16, 256, 4, 4),
    (32, 64, 32, 256, 4, 4),
    # M=64 (sweep of commit 881aff9, PTX decode): (64,64,128) 4 warps 3 stages faster than (128,64,64) on all six
    # SeedVR2 shapes, 0.017-0.033 ms vs 0.020-0.050 ms (0.91-1.30x bf16 cuBLAS)
    (64, 64, 64, 128, 4, 3),
    # M=256, 6 SeedVR2 shapes x 6 tiles x SPLIT_K 1..12, PTX decode (bench_nvfp4 --sweep --sweep-m 256,4096, commit
    # fa97e0e): (64,128,128) 4 warps fastest on all 6 shapes, 0.026-0.068 ms (0.58-0.82x bf16 cuBLAS); the former
    # (64,128,64) row 0.029-0.077 ms at its best SPLIT_K; 128-row and 256-token tiles 10-40 % slower
    (1 << 30, 64, 128, 128, 4, 3),
]
# decode NVFP4 codes with the PTX byte-table routine (``e2m1_pairs_scaled``) in the fused W4A16 kernel and the
# dequantize kernel; off = the arithmetic decode / the table gather (the only ones the Triton interpreter can
# run). SEEDVR2BW_W4A16_ASM=off turns it off on a GPU.
W4A16_ASM_DECODE = knobs.get("W4A16_ASM")


def w4a16_config(m: int, n: int, k: int, device, configs=None):
    """(BLOCK_N, BLOCK_M, BLOCK_K, SPLIT_K, num_warps, num_stages) for an [m, k] x [n, k]^T product."""
    for row in (configs or W4A16_CONFIGS):
        if m <= row[0]:
            _, bn, bm, bk, w, st = row
            break
    tiles = -(-n // bn) * -(-m // bm)
    sk = launch.splitk_for(tiles, -(-k // bk), m, n, launch.sm_count(torch.device(device)))
    return bn, bm, bk, sk, w, st


def w4a16_linear(x: torch.Tensor, packed, block_scale, global_scale, n: int, bias=None, config=None):
    """y[M, n] = x[M, Kp] @ dequant(W)^T (+ bias), fp32 accumulation, output in x's dtype (bf16 / fp16).
    x must already be padded to the weight's padded K. One launch (two with split-K: partials + reduce)."""
    launch.check_triton(x)
    M, K = x.shape
    if packed.shape[1] * 2 != K:
        raise ValueError(f"activation K={K} does not match the packed weight's K={packed.shape[1] * 2}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        x = x.to(torch.bfloat16)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((M, n), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    config = tuple(config or w4a16_config(M, n, K, x.device))
    sk = config[3]
    ws = torch.empty((sk, M, n), dtype=torch.float32, device=x.device) if sk > 1 else y
    for fn, grid, args, consts, nw, ns in w4a16_launches(x, packed, block_scale, g, bias, y, ws, M, n, K,
                                                          config):
        launch.launch(fn, grid, args, consts, nw, ns)
    return y


def w4a16_launches(x, packed, block_scale, g, bias, y, ws, M, n, K, config):
    """The (kernel, grid, args, constexprs, num_warps, num_stages) launches of one ``w4a16_linear`` call."""
    bn, bm, bk, sk, w, st = config[:6]
    # optional 7th / 8th entries (the benchmark's sweep): PTX decode, transposed store
    asm = bool(config[6]) if len(config) > 6 else W4A16_ASM_DECODE
    trans = bool(config[7]) if len(config) > 7 else False
    has_bias = bias is not None
    b = bias if has_bias else g
    k_tiles = -(-K // bk)
    if bk % 64:
        raise ValueError(f"BLOCK_K={bk} is not a multiple of 64 (a K tile must cover whole 128x4 scale groups)")
    if k_tiles % sk:
        raise ValueError(f"SPLIT_K={sk} does not divide the {k_tiles} K tiles")
    grid = (-(-n // bn), -(-M // bm), sk)
    out = [(w4a16_swab_kernel, grid, (x, packed, block_scale, g, b, y, ws, M, n, K, x.stride(0),
                                       block_scale.shape[1] // 4, k_tiles // sk),
            dict(HAS_BIAS=has_bias, EVEN_K=(K % bk == 0), BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=sk,
                 ASM_DECODE=asm and not launch.INTERPRET, TRANS_STORE=trans and sk == 1), w, st)]
    if sk > 1:
        out.append(launch.reduce_launch(ws, g, bias, y, M, n, sk))
    return out
