"""Triton kernels of the VAE (imported only when Triton is present): per-frame GroupNorm [+ SiLU] on NCDHW and on
channels-last 3-D, a conv's bias add, the ResNet residual add, the upsamplers' depth-to-space, and the split
softmax of the mid-block attention. Arithmetic in fp32, rounded where the torch ops they replace round (see
``__init__`` for the byte counts).
"""

import torch
import triton
import triton.language as tl

from .reference import merge_moments


# --------------------------------------------------------------------------------------------------
# (f) per-frame GroupNorm [+ SiLU] of a (B, C, T, H*W) tensor (the VAE's causal norms)
# --------------------------------------------------------------------------------------------------
# torch's GroupNorm gives one program per (sample, group) row: a 720p frame batch has a few hundred rows of
# millions of values each, so its statistics kernel ran at a fraction of the bandwidth (58 % of a VAE decode on
# an H100). Here every (channel plane, hw block) is one program; a few torch ops combine the partial moments
# (Chan et al.'s pairwise formula), and one pass applies the norm and the SiLU straight on the 5-D layout.
@triton.jit
def _gn_moments_kernel(X, PART, HW, T, C, CG, NBLK, BLOCK: tl.constexpr):
    plane = tl.program_id(0).to(tl.int64)          # (b * C + c) * T + t
    j = tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HW
    x = tl.load(X + plane * HW + offs, mask=mask, other=0.0).to(tl.float32)
    n = tl.minimum(HW - j * BLOCK, BLOCK).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    d = tl.where(mask, x - mean, 0.0)
    m2 = tl.sum(d * d, axis=0)
    t = plane % T
    c = (plane // T) % C
    b = plane // (C * T)
    row = (b * (C // CG) + c // CG) * T + t          # (sample, group, frame)
    idx = (row * CG + c % CG) * NBLK + j
    tl.store(PART + 2 * idx, mean)
    tl.store(PART + 2 * idx + 1, m2)


@triton.jit
def _gn_apply_kernel(X, Y, MEAN, RSTD, W, BIAS, HW, T, C, CG, SILU: tl.constexpr, BLOCK: tl.constexpr):
    plane = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    t = plane % T
    c = (plane // T) % C
    b = plane // (C * T)
    row = (b * (C // CG) + c // CG) * T + t
    # torch's fused parameters: y = x * a + (beta - mean * a), a = rstd * gamma, in fp32
    a = tl.load(RSTD + row) * tl.load(W + c).to(tl.float32)
    sh = tl.load(BIAS + c).to(tl.float32) - tl.load(MEAN + row) * a
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HW
    x = tl.load(X + plane * HW + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * a + sh).to(Y.dtype.element_ty)
    if SILU:  # the torch path applies SiLU to the rounded norm output
        yf = y.to(tl.float32)
        y = (yf / (1.0 + tl.exp(-yf))).to(Y.dtype.element_ty)
    tl.store(Y + plane * HW + offs, y, mask=mask)


# The same on the channels-last 3-D layout (memory order B, T, H, W, C: what cuDNN's convolutions read and write
# without transposing). A frame is an (H*W, C) matrix; both kernels read whole rows of it (every channel of a pixel:
# contiguous, coalesced) and index their statistics per column, not per element. The moments programs take (block of
# a frame's rows, frame) and give each channel's (mean, M2) over their rows; the channels of a group are merged after,
# with the blocks. The apply programs take (block of a frame's rows, frame, block of channels).
@triton.jit
def _gn_cl_moments_kernel(X, IN_B, PART, HW, C, NBLK, ROWS, HAS_IN_B: tl.constexpr, SUB: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    j = tl.program_id(0)
    frame = tl.program_id(1).to(tl.int64)        # b * T + t
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    r0 = j * ROWS
    if HAS_IN_B:      # the producing conv's bias, added here and rounded to x's dtype as its own pass would
        ib = tl.load(IN_B + cols, mask=cmask, other=0.0).to(tl.float32)
    # sums of x - shift per (row of the tile, channel), reduced once at the end: no reduction across the
    # program's threads inside the loop. The shift, the block's first row, keeps the sums near zero so that
    # M2 = Q - S^2 / n loses nothing to cancellation.
    shift = tl.load(X + (frame * HW + r0) * C + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_IN_B:
        shift = (shift + ib).to(X.dtype.element_ty).to(tl.float32)
    acc_s = tl.zeros([SUB, BLOCK_C], tl.float32)
    acc_q = tl.zeros([SUB, BLOCK_C], tl.float32)
    for s in range(0, ROWS, SUB):
        rows = r0 + s + tl.arange(0, SUB)
        mask = (rows < HW)[:, None] & cmask[None, :]
        x = tl.load(X + (frame * HW + rows[:, None]) * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_IN_B:
            x = (x + ib[None, :]).to(X.dtype.element_ty).to(tl.float32)
        d = tl.where(mask, x - shift[None, :], 0.0)
        acc_s += d
        acc_q += d * d
    n = tl.minimum(HW - r0, ROWS).to(tl.float32)
    sm = tl.sum(acc_s, axis=0)
    idx = (frame * NBLK + j) * C + cols                     # (sample, frame, block, channel)
    tl.store(PART + 2 * idx, shift + sm / n, mask=cmask)
    tl.store(PART + 2 * idx + 1, tl.maximum(tl.sum(acc_q, axis=0) - sm * sm / n, 0.0), mask=cmask)


@triton.jit
def store_edges(Y, dst, v, mask, f, HEAD, YT, K, K0, KB, KT, b, off, HAS_K: tl.constexpr):
    """A causal conv input's other copies of an output tile of frame f (``group_norm_frames_cl``): frame 0 also into
    the HEAD frames in front of it, frames from K0 on also into K (from its frame 0, at ``off`` in the frame)."""
    if f == 0:
        for i in range(1, HEAD + 1):
            tl.store(Y + dst - i * YT, v, mask=mask)
    if HAS_K:
        if f >= K0:
            tl.store(K + b * KB + (f - K0) * KT + off, v, mask=mask)


@triton.jit
def _gn_cl_apply_kernel(X, IN_B, Y, MEAN, RSTD, W, BIAS, HW, WIDTH, T, C, CG, G, YB, YT, YH, HEAD, K, K0, KB, KT,
                        KH, SILU: tl.constexpr, HAS_IN_B: tl.constexpr, HAS_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    p = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)     # pixels of the frame
    frame = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (p < HW)[:, None] & cmask[None, :]
    b = frame // T
    t = frame % T
    stat = (b * G + cols // CG) * T + t
    # torch's fused parameters: y = x * a + (beta - mean * a), a = rstd * gamma, in fp32; one per channel here
    a = tl.load(RSTD + stat, mask=cmask, other=0.0) * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    sh = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32) - tl.load(MEAN + stat, mask=cmask, other=0.0) * a
    x = tl.load(X + (frame * HW + p[:, None]) * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_IN_B:
        x = (x + tl.load(IN_B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]).to(X.dtype.element_ty)
        x = x.to(tl.float32)
    y = (x * a[None, :] + sh[None, :]).to(Y.dtype.element_ty)
    if SILU:
        yf = y.to(tl.float32)
        y = (yf / (1.0 + tl.exp(-yf))).to(Y.dtype.element_ty)
    # Y may be a window of a larger buffer (rows of a band between its neighbours' halo rows): strided per sample,
    # frame and row; a row's pixels and channels are dense
    h = p // WIDTH
    yrow = b * YB + t * YT + h * YH + (p - h * WIDTH) * C
    tl.store(Y + yrow[:, None] + cols[None, :], y, mask=mask)
    store_edges(Y, yrow[:, None] + cols[None, :], y, mask, t, HEAD, YT, K, K0, KB, KT, b,
           (h * KH + (p - h * WIDTH) * C)[:, None] + cols[None, :], HAS_K=HAS_K)


@triton.jit
def _rounded(v, DT: tl.constexpr):
    """float32 v rounded to DT (to nearest, ties to even) and back. For bfloat16 by its bits: the same as a GPU's
    conversion, and the Triton interpreter, which truncates there, then gives it too."""
    if DT == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        return ((u >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(DT).to(tl.float32)


@triton.jit
def _partials(i, base, total, NBLK, C, CG, ROWS, LAST, BLOCK: tl.constexpr):
    """A tile of a group's partial moments from the i-th: (mask, offset of each mean (M2 follows), its count)."""
    idx = i + tl.arange(0, BLOCK)
    j = idx // CG                                # the block of rows; idx % CG the group's channel
    cnt = tl.where(j == NBLK - 1, LAST, ROWS).to(tl.float32)
    return idx < total, 2 * (base + j * C + idx % CG), cnt


@triton.jit
def _gn_cl_stats_kernel(X, PART, MEAN, RSTD, T, G, C, CG, NBLK, ROWS, LAST, N, EPS, BLOCK: tl.constexpr):
    # one program per (sample, group, frame): its channels' (mean, M2) of every block of rows merged (Chan et al.,
    # as ``merge_moments``), then mean and rstd rounded to x's dtype and back, as torch's CUDA GroupNorm does
    r = tl.program_id(0)                       # (b * G + g) * T + t, the apply kernel's index
    t = r % T
    g = (r // T) % G
    b = r // (T * G)
    base = (b * T + t).to(tl.int64) * NBLK * C + g * CG
    total = NBLK * CG
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, total, BLOCK):
        m, off, cnt = _partials(i, base, total, NBLK, C, CG, ROWS, LAST, BLOCK)
        acc += tl.where(m, tl.load(PART + off, mask=m, other=0.0) * cnt, 0.0)
    mean = tl.sum(acc, axis=0) / N
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, total, BLOCK):
        m, off, cnt = _partials(i, base, total, NBLK, C, CG, ROWS, LAST, BLOCK)
        d = tl.load(PART + off, mask=m, other=0.0) - mean
        acc += tl.where(m, tl.load(PART + off + 1, mask=m, other=0.0) + cnt * d * d, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + EPS)
    tl.store(MEAN + r, _rounded(mean, X.dtype.element_ty))
    tl.store(RSTD + r, _rounded(rstd, X.dtype.element_ty))


def _combine_moments(part, cnt, n, eps, dtype):
    """mean and rstd of each row of ``part`` over ``n`` values (``merge_moments``), rounded to ``dtype`` and back
    as torch's CUDA GroupNorm does."""
    mean, m2 = merge_moments(part, cnt, n)
    rstd = torch.rsqrt(m2 / n + eps)
    return mean.to(dtype).float(), rstd.to(dtype).float()


MOMENT_PROGRAMS = 1024
# a frame's pixels per program of the residual pass that also takes moments: it reads two tensors and writes one,
# and keeps the copy rate only with many programs (H100, 720p x 4 frames x 128 channels: 1.00 ms at 256 rows, 1.10
# at 2048, against 0.98 for the pass without moments)
RESIDUAL_MOMENT_ROWS = 256


def _moments_blocks(x, block_rows=None, sub=32, most=2048):
    """(part, rows, sub): an empty (B, T, blocks, C, 2) float32 for the per-channel (mean, M2) of each block of
    ``rows`` of a frame's pixels of x (B, C, T, H, W), and the programs' tile of rows, at most ``sub``, that divides
    ``rows`` (a runtime loop over it: no compile per shape). About MOMENT_PROGRAMS blocks in all (a small latent
    frame still fills the GPU), at most ``most`` rows each (the partials stay small)."""
    b, c, t, h, w = x.shape
    per = block_rows or min(most, max(1, -(-b * t * h * w // MOMENT_PROGRAMS)))
    sub = min(sub, triton.next_power_of_2(per))
    rows = -(-per // sub) * sub
    nblk = triton.cdiv(h * w, rows)
    return torch.empty((b, t, nblk, c, 2), device=x.device, dtype=torch.float32), rows, sub


def keep_args(keep, y, t):
    """The kernels' (K, K0, KB, KT, KH) for ``keep``: the last keep.shape[2] of t frames also written there."""
    if keep is None:
        return y, t, 0, 0, 0
    return keep, t - keep.shape[2], keep.stride(0), keep.stride(2), keep.stride(3)


def group_norm_frames_cl(x, groups, weight, bias, eps, silu=False, block_rows=None, out=None, combine=None,
                         in_bias=None, head=0, keep=None, moments=None):
    """``group_norm_frames`` of x (B, C, T, H, W) (plus ``in_bias`` (C,) per channel when given, the sum rounded to
    x's dtype: the bias of the conv that made x) stored channels-last 3-D; the output is stored the same way, in
    ``out`` if given (x's shape and dtype; channels and a row's pixels dense, samples, frames and rows at any
    stride: e.g. a run of frames and rows inside a larger buffer). ``block_rows``: a frame's pixels per moments
    program. ``combine`` (for a band of a frame's rows): takes this band's (rows, 2) float32 (mean, M2) per (sample,
    group, frame) and its value count per row, returns every band's as (rows, bands, 2) and (bands,), whose merge
    gives the whole frame's statistics. ``head`` (with ``out``): the first frame is also written into the ``head``
    frames before ``out`` in its storage (at its frame stride); ``keep`` (B, C, k, H, W; channels and a row's pixels
    dense): the last k frames are also written there. A causal conv's input takes both (``fill_edges``). ``moments``:
    x's partial statistics, already taken (``residual_bias_cl``); none is taken here then."""
    b, c, t, h, w = x.shape
    has_b = in_bias is not None
    mean, rstd = group_norm_stats_cl(x, groups, eps, block_rows, combine, in_bias, moments)
    y = torch.empty_like(x) if out is None else out     # keeps the channels-last strides
    block_c2, block_r2, warps = _apply_tile(c)
    grid = (triton.cdiv(h * w, block_r2), b * t, triton.cdiv(c, block_c2))
    _gn_cl_apply_kernel[grid](x, in_bias if has_b else weight, y, mean, rstd, weight, bias, h * w, w, t, c,
                              c // groups, groups, y.stride(0), y.stride(2), y.stride(3),
                              head if out is not None else 0, *keep_args(keep, y, t), SILU=silu, HAS_IN_B=has_b,
                              HAS_K=keep is not None, BLOCK_R=block_r2, BLOCK_C=block_c2, num_warps=warps)
    return y


def group_norm_stats_cl(x, groups, eps, block_rows=None, combine=None, in_bias=None, moments=None):
    """(mean, rstd) float32 per (sample, group, frame), (b * groups + g) * T + t, of x (+ ``in_bias``) channels-last
    3-D, rounded to x's dtype and back as torch's CUDA GroupNorm does: ``group_norm_frames_cl``'s statistics (its
    arguments of those names)."""
    b, c, t, h, w = x.shape
    hw = h * w
    cg = c // groups
    has_b = in_bias is not None
    in_b = in_bias if has_b else x
    if moments is not None:
        if has_b:
            raise ValueError("group_norm_frames_cl: moments are of x itself, without an in_bias")
        part, rows = moments
    else:
        block_c = triton.next_power_of_2(c)
        part, rows, sub = _moments_blocks(x, block_rows, sub=min(64, max(1, 4096 // block_c)))
        _gn_cl_moments_kernel[(part.shape[2], b * t)](x, in_b, part, hw, c, part.shape[2], rows, HAS_IN_B=has_b,
                                                      SUB=sub, BLOCK_C=block_c, num_warps=4)
    nblk = part.shape[2]
    if part.shape != (b, t, nblk, c, 2) or nblk != triton.cdiv(hw, rows):
        raise ValueError(f"group_norm_frames_cl: moments of shape {tuple(part.shape)} in blocks of {rows} rows do "
                         f"not describe x of shape {tuple(x.shape)}")
    n, last = cg * hw, hw - (nblk - 1) * rows
    if combine is None:
        # one kernel merges a group's partials: the dozen small torch ops it replaces cost more to launch than to
        # run, which bounds small tiles by the CPU
        mean = torch.empty(b * groups * t, device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        block = min(1024, triton.next_power_of_2(nblk * cg))
        _gn_cl_stats_kernel[(b * groups * t,)](x, part, mean, rstd, t, groups, c, cg, nblk, rows, last, float(n),
                                               float(eps), BLOCK=block, num_warps=4)
    else:
        # a group's partials: its channels of every block, each over that block's pixels
        part = part.view(b, t, nblk, groups, cg, 2).permute(0, 3, 1, 2, 4, 5).reshape(b * groups * t, nblk * cg, 2)
        cnt = torch.full((nblk,), float(rows), device=x.device)
        cnt[-1:].fill_(last)   # a fill: a Python number assigned would sync
        cnt = cnt[:, None].expand(nblk, cg).reshape(-1)      # each channel of a block: that block's pixels
        part, cnt = combine(torch.stack(merge_moments(part, cnt, n), dim=1), n)
        mean, rstd = _combine_moments(part, cnt, cnt.sum(), eps, x.dtype)
    return mean, rstd


def _apply_tile(c):
    """(channels, rows, warps) of a program of the channels-last elementwise passes. Swept on an H100 over 64-256
    channels x 16-256 rows x 4/8 warps at the decoder's shapes: 32 rows of up to 256 channels reach 2.7-3.0 TB/s
    (128 x 64 on 8 warps, the earlier tile, 1.7-2.2); 512-channel frames take 8 warps."""
    block_c = min(triton.next_power_of_2(c), 256)
    return block_c, max(32, 1024 // block_c), 8 if c >= 512 else 4


@triton.jit
def _softmax_split_kernel(S, HL, L, N, SCALE, BLOCK: tl.constexpr):
    # one program per row of S (rows, N) float32: e = exp(SCALE * (s - max)), the softmax numerator, written as two
    # parts of HL's dtype, hi = e rounded (columns [0, N) of HL's row) and lo = e - hi rounded ([N, 2N)), and the
    # row's sum of e in L
    row = tl.program_id(0).to(tl.int64)
    src = S + row * N
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for i in range(0, N, BLOCK):
        cols = i + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(src + cols, mask=cols < N, other=float("-inf")))
    mx = tl.max(m, axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    dst = HL + row * 2 * N
    for i in range(0, N, BLOCK):
        cols = i + tl.arange(0, BLOCK)
        mask = cols < N
        e = tl.exp((tl.load(src + cols, mask=mask, other=float("-inf")) - mx) * SCALE)
        acc += e
        hi = _rounded(e, HL.dtype.element_ty)
        tl.store(dst + cols, hi.to(HL.dtype.element_ty), mask=mask)
        tl.store(dst + N + cols, (e - hi).to(HL.dtype.element_ty), mask=mask)
    tl.store(L + row, tl.sum(acc, axis=0))


def softmax_split(s, scale, dtype):
    """(hl, l) for the scores s (rows, N) float32, contiguous: the softmax numerator e = exp(scale * (s - row max))
    as hl (rows, 2N) of ``dtype``, e's rounding in columns [0, N) and what rounding left out in [N, 2N) (their sum
    holds e to about twice the dtype's bits), and l (rows,) float32, the sum of e over each row. ``hl @ [v; v] / l``
    is the attention output with the probabilities' rounding error squared."""
    rows, n = s.shape
    hl = torch.empty((rows, 2 * n), device=s.device, dtype=dtype)
    l = torch.empty(rows, device=s.device, dtype=torch.float32)
    _softmax_split_kernel[(rows,)](s, hl, l, n, float(scale), BLOCK=min(2048, triton.next_power_of_2(n)),
                                   num_warps=8)
    return hl, l


@triton.jit
def _row_tile(NROWS, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile of a (NROWS, C) row-major matrix: (rows, cols, column mask, mask, offsets)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < NROWS)[:, None] & cmask[None, :]
    return rows, cols, cmask, mask, rows[:, None] * C + cols[None, :]


@triton.jit
def _bias_add_kernel(Y, B, NROWS, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, cmask, mask, off = _row_tile(NROWS, C, BLOCK_R, BLOCK_C)
    y = tl.load(Y + off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(Y + off, (y + b[None, :]).to(Y.dtype.element_ty), mask=mask)


def bias_add_cl(y, bias):
    """y + bias (per channel) written into y, dense channels-last 3-D: torch's broadcast add on this layout runs at
    about 1.3 TB/s on an H100, this pass at the copy rate. Rounded as that add rounds."""
    c = y.shape[1]
    nrows = y.numel() // c
    block_c, block_r, warps = _apply_tile(c)
    grid = (triton.cdiv(nrows, block_r), triton.cdiv(c, block_c))
    _bias_add_kernel[grid](y, bias, nrows, c, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return y


@triton.jit
def _residual_value(H, X, B, XB, off, cols, cmask, mask, HAS_XB: tl.constexpr):
    """h + bias + x of a tile in float32, rounded where the two adds it replaces round: (h + bias), then + x."""
    h = tl.load(H + off, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_XB:        # x's own conv bias, left out of it: added and rounded first, as its own pass would
        x = (x + tl.load(XB + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]).to(H.dtype.element_ty)
        x = x.to(tl.float32)
    return (h + b).to(H.dtype.element_ty).to(tl.float32) + x


@triton.jit
def _residual_bias_kernel(H, X, B, XB, OUT, NROWS, C, HW, WIDTH, T, OB, OT, OH, HAS_XB: tl.constexpr,
                          STRIDED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, cols, cmask, mask, off = _row_tile(NROWS, C, BLOCK_R, BLOCK_C)
    y = _residual_value(H, X, B, XB, off, cols, cmask, mask, HAS_XB=HAS_XB).to(OUT.dtype.element_ty)
    if STRIDED:       # OUT: a window of a larger buffer, strided per sample, frame and row (a row dense)
        p = rows % HW
        f = rows // HW
        r = p // WIDTH
        dst = (f // T) * OB + (f % T) * OT + r * OH + (p - r * WIDTH) * C
        tl.store(OUT + dst[:, None] + cols[None, :], y, mask=mask)
    else:
        tl.store(OUT + off, y, mask=mask)


@triton.jit
def _residual_moments_kernel(H, X, B, XB, OUT, PART, HW, C, NBLK, ROWS, HAS_XB: tl.constexpr, SUB: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    # the residual sum of ROWS of a frame's pixels (program (block, frame, block of channels)), and its channels'
    # (mean, M2) over them, as ``_gn_cl_moments_kernel`` gives them: the GroupNorm that reads the sum next skips
    # its own pass over it. Shifted by the block's first row, as there.
    j = tl.program_id(0)
    frame = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    r0 = j * ROWS
    first = (frame * HW + r0) * C + cols
    shift = _residual_value(H, X, B, XB, first[None, :], cols, cmask, cmask[None, :], HAS_XB=HAS_XB)
    shift = tl.sum(shift.to(OUT.dtype.element_ty).to(tl.float32), axis=0)
    acc_s = tl.zeros([SUB, BLOCK_C], tl.float32)
    acc_q = tl.zeros([SUB, BLOCK_C], tl.float32)
    for s in range(0, ROWS, SUB):
        rows = r0 + s + tl.arange(0, SUB)
        mask = (rows < HW)[:, None] & cmask[None, :]
        off = (frame * HW + rows[:, None]) * C + cols[None, :]
        y = _residual_value(H, X, B, XB, off, cols, cmask, mask, HAS_XB=HAS_XB).to(OUT.dtype.element_ty)
        tl.store(OUT + off, y, mask=mask)
        d = tl.where(mask, y.to(tl.float32) - shift[None, :], 0.0)
        acc_s += d
        acc_q += d * d
    n = tl.minimum(HW - r0, ROWS).to(tl.float32)
    sm = tl.sum(acc_s, axis=0)
    idx = (frame * NBLK + j) * C + cols
    tl.store(PART + 2 * idx, shift + sm / n, mask=cmask)
    tl.store(PART + 2 * idx + 1, tl.maximum(tl.sum(acc_q, axis=0) - sm * sm / n, 0.0), mask=cmask)


def residual_bias_cl(h, x, bias, x_bias=None, out=None, moments=False, most_rows=RESIDUAL_MOMENT_ROWS):
    """h + bias + x (bias per channel) in one pass, rounded as the two adds ``h.add_(bias).add_(x)`` round; h and x
    (B, C, T, H, W) dense channels-last 3-D of the same shape (a (rows, C) matrix each). Written into h and
    returned, or into ``out`` (h's shape and dtype; channels and a row's pixels dense, samples, frames and rows at
    any stride: e.g. the body of a conv's padded input). ``x_bias`` (C,): x lacks its conv's bias, added and
    rounded first (as ``x + x_bias`` would). ``moments`` (written into h only): returns (sum, moments), the second
    the per-frame partial statistics ``group_norm_frames_cl`` takes, from the same pass, in blocks of at most
    ``most_rows`` of a frame's pixels."""
    _, c, t, hh, w = h.shape
    nrows = h.numel() // c
    o = h if out is None else out
    block_c, block_r, warps = _apply_tile(c)
    has_xb, xb = x_bias is not None, bias if x_bias is None else x_bias
    if moments:
        if out is not None:
            raise ValueError("residual_bias_cl: moments are taken of a sum written into h")
        part, rows, sub = _moments_blocks(h, sub=block_r, most=most_rows)
        grid = (part.shape[2], nrows // (hh * w), triton.cdiv(c, block_c))
        _residual_moments_kernel[grid](h, x, bias, xb, h, part, hh * w, c, part.shape[2], rows, HAS_XB=has_xb,
                                       SUB=sub, BLOCK_C=block_c, num_warps=warps)
        return h, (part, rows)
    grid = (triton.cdiv(nrows, block_r), triton.cdiv(c, block_c))
    _residual_bias_kernel[grid](h, x, bias, xb, o, nrows, c, hh * w, w, t, o.stride(0), o.stride(2), o.stride(3),
                                HAS_XB=has_xb, STRIDED=out is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                                num_warps=warps)
    return o


@triton.jit
def _depth_to_space_kernel(Y, B, OUT, HW, WIDTH, T, CR, C, S, RT, OB, OT, OH, HEAD, K, K0, KB, KT, KH,
                           DROP: tl.constexpr, HAS_B: tl.constexpr, HAS_K: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    p = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)     # source pixels of the frame
    bt = tl.program_id(1)
    qc = tl.program_id(2)
    nq = S * S * RT
    q = qc % nq                           # ((sx * S + sy) * RT + st): which output pixel and frame
    cols = (qc // nq) * BLOCK_C + tl.arange(0, BLOCK_C)
    st = q % RT
    sy = (q // RT) % S
    sx = q // (RT * S)
    b = (bt // T).to(tl.int64)
    t = bt % T
    f = t * RT + st                       # output frame before the first chunk's duplicate is dropped
    cmask = cols < C
    pmask = p < HW
    if DROP:
        pmask = pmask & ((p * 0 + f) != 1)     # a vector: the frame's test on every pixel of the tile
        f = tl.where(f > 1, f - 1, f)
    mask = pmask[:, None] & cmask[None, :]
    src = (bt.to(tl.int64) * HW + p[:, None]) * CR + q * C + cols[None, :]
    v = tl.load(Y + src, mask=mask, other=0.0)
    if HAS_B:         # the 1 x 1 conv's bias, added and rounded as its own pass would
        v = (v.to(tl.float32) + tl.load(B + q * C + cols, mask=cmask, other=0.0).to(tl.float32)[None, :])
    h = p // WIDTH
    w = p - h * WIDTH
    dst = b * OB + f.to(tl.int64) * OT + (h * S + sx) * OH + (w * S + sy) * C
    v = v.to(OUT.dtype.element_ty)
    tl.store(OUT + dst[:, None] + cols[None, :], v, mask=mask)
    store_edges(OUT, dst[:, None] + cols[None, :], v, mask, f, HEAD, OT, K, K0, KB, KT, b,
           ((h * S + sx) * KH + (w * S + sy) * C)[:, None] + cols[None, :], HAS_K=HAS_K)


def depth_to_space_cl(y, bias, out, s, rt, drop, head=0, keep=None):
    """The upsampler's rearrangement of y (B, s*s*rt*C, T, H, W), dense channels-last 3-D, plus ``bias`` (s*s*rt*C,)
    when given (y lacks its conv's bias; the sum rounded as a pass of its own would), written into ``out`` (B, C,
    T*rt (- 1 if ``drop``), H*s, W*s): channels and a row's pixels dense, samples, frames and rows at any stride.
    Channel ((sx*s + sy)*rt + st)*C + c of source pixel (t, h, w) goes to output frame t*rt + st (the first chunk's
    frame 1 dropped when ``drop``), pixel (h*s + sx, w*s + sy). ``head``, ``keep``: as ``group_norm_frames_cl``'s."""
    b, cr, t, h, w = y.shape
    c = cr // (s * s * rt)
    block_c = min(triton.next_power_of_2(c), 256)
    block_p = max(1, 8192 // block_c)
    nc = triton.cdiv(c, block_c)
    grid = (triton.cdiv(h * w, block_p), b * t, s * s * rt * nc)
    _depth_to_space_kernel[grid](y, y if bias is None else bias, out, h * w, w, t, cr, c, s, rt, out.stride(0),
                                 out.stride(2), out.stride(3), head, *keep_args(keep, out, out.shape[2]),
                                 DROP=bool(drop), HAS_B=bias is not None, HAS_K=keep is not None,
                                 BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8)
    return out


def group_norm_frames(x, groups, weight, bias, eps, silu=False, block=4096):
    """GroupNorm of x (B, C, T, H, W) over (channels of a group, H, W) for every frame on its own, then SiLU
    if asked; x contiguous. Statistics in fp32 (mean and M2 per block, combined pairwise), then rounded to x's
    dtype as torch's CUDA kernel does."""
    b, c, t = x.shape[:3]
    hw = x[0, 0, 0].numel()
    cg = c // groups
    nblk = triton.cdiv(hw, block)
    rows = b * groups * t
    part = torch.empty((rows, cg, nblk, 2), device=x.device, dtype=torch.float32)
    grid = (b * c * t, nblk)
    _gn_moments_kernel[grid](x, part, hw, t, c, cg, nblk, BLOCK=block, num_warps=8)
    cnt = torch.full((nblk,), float(block), device=x.device)
    cnt[-1:].fill_(hw - (nblk - 1) * block)
    # torch's CUDA GroupNorm stores mean and rstd in the input dtype before applying them: so do we, so that the
    # output is the official model's on a GPU (without this, half of the bf16 outputs differ by one unit)
    mean, rstd = _combine_moments(part.view(rows, cg * nblk, 2), cnt.repeat(cg), cg * hw, eps, x.dtype)
    y = torch.empty_like(x)
    _gn_apply_kernel[grid](x, y, mean, rstd, weight, bias, hw, t, c, cg, SILU=silu, BLOCK=block, num_warps=8)
    return y
